"""One device and dtype for every system a benchmark compares.

pdserve's engine picks CUDA when it sees a GPU and then defaults to bfloat16 (engine/model/loader.py); a
transformers baseline loaded the plain way stays on CPU in float32. Compared like that, the figure
measures the hardware, not the engine. Each benchmark resolves one ``BenchDevice`` here and hands the
same record to pdserve and to its baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class BenchDevice:
    device: str  # "cpu" or "cuda"
    dtype: str  # a key of DTYPES: weights, activations and KV cache of every system

    def __post_init__(self):
        assert self.device in ("cpu", "cuda") and self.dtype in DTYPES, (self.device, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        return f"{self.device} {self.dtype}"


def choose_device(device: str | None, dtype: str | None, cuda_available: bool) -> BenchDevice:
    """``device``/``dtype`` as asked, else what pdserve's engine would pick here: CUDA when there is a
    GPU, bfloat16 on CUDA and float32 on CPU ("auto" is the engine's word for that default)."""
    device = device or ("cuda" if cuda_available else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu or cuda")
    if device == "cuda" and not cuda_available:
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    if dtype in (None, "auto"):
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)} or auto")
    return BenchDevice(device, dtype)


def add_device_args(parser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where every system runs (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=(*DTYPES, "auto"),
        default=None,
        help="dtype of every system (default auto: bfloat16 on cuda, float32 on cpu)",
    )
