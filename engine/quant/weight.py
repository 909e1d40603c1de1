"""The record of one quantized ``[out_features, in_features]`` weight: its raw rows and their format.

Every format lays a weight out row by row, each output row one run of ``row_bytes`` bytes (GGUF's own
layout: a tensor's data is its rows of blocks), so a fused projection (q/k/v, gate/up) is the rows of
its parts concatenated, and llama.cpp's q/k row permutation is undone by indexing rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# values per block and bytes per block of each format (gguf.GGML_QUANT_SIZES for the GGUF ones); I8 is
# this package's per-channel int8 (engine/quant/int8.py): 4 bytes of float scale, then the row's int8s
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
    # 16-bit values as they are, one per 2 bytes: kernels/cpu/half.c's formats (no blocks, no scales)
    "F16": (1, 2),
    "BF16": (1, 2),
}


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes one output row of ``in_features`` values takes in ``type_name``."""
    if type_name == "I8":
        return 4 + in_features
    block, size = BLOCKS[type_name]
    return in_features // block * size


def values_per_block(type_name: str) -> int:
    return 32 if type_name == "I8" else BLOCKS[type_name][0]


@dataclass(slots=True)
class QuantizedWeight:
    """A linear's weight as rows of quantized blocks."""

    type_name: str  # a key of BLOCKS, or "I8"
    rows: torch.Tensor  # [out_features, row_bytes] uint8, contiguous, on CPU
    in_features: int  # values per row (a multiple of the format's block)

    def __post_init__(self) -> None:
        if self.type_name != "I8" and self.type_name not in BLOCKS:
            raise ValueError(f"no quantized kernel for {self.type_name}; kernels: {', '.join([*BLOCKS, 'I8'])}")
        block = values_per_block(self.type_name)
        if self.in_features % block:
            raise ValueError(f"{self.type_name} rows hold multiples of {block} values, not {self.in_features}")
        assert self.rows.dtype == torch.uint8 and self.rows.dim() == 2 and self.rows.is_contiguous()
        assert self.rows.shape[1] == row_bytes(self.type_name, self.in_features), (self.rows.shape, self.type_name)

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The fused weight whose rows are the parts' rows in order (qkv, gate_up); one format, one width."""
    first = parts[0]
    if any(p.type_name != first.type_name or p.in_features != first.in_features for p in parts):
        found = ", ".join(f"{p.type_name} [{p.out_features}, {p.in_features}]" for p in parts)
        raise ValueError(f"a fused projection needs parts of one format and width; got {found}")
    return QuantizedWeight(first.type_name, torch.cat([p.rows for p in parts]), first.in_features)


def take_rows(weight: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The weight with its rows reordered by ``index`` (llama.cpp's q/k row order undone: whole rows move)."""
    return QuantizedWeight(weight.type_name, weight.rows[index].contiguous(), weight.in_features)
