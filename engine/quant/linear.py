"""``x @ W^T`` for a quantized weight, in one of two forms picked per row count at start (engine/quant/forms.py):

- ``int``: the C kernel straight from the blocks (kernels/cpu/quant.c): the activations quantized to int8
  blocks (one term, or two: ``model.quant_activations``) once per call, integer dot products; for F16/BF16
  rows kernels/cpu/half.c (kernel_inputs.py).
  Reads the weight's bytes once per call whatever the rows, so it is the form for decode steps, where
  streaming the weight is the whole cost.
- ``panel``: up to ``PANEL_ROWS`` weight rows at a time dequantized to a float32 panel (C), then torch's
  matmul on it, of x rounded as the ``int`` kernel rounds it (kernel_inputs.py): the two forms
  differ only in the order of float32 sums, so the timed pick does not change the output. A long prefill
  is arithmetic-bound: oneDNN's blocked GEMM beats the row-at-a-time integer kernel there, and
  dequantizing a panel costs one pass over it per call, small beside the matmul.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu_linear import ROW_BUCKETS
from engine.quant.kernel_inputs import kernel_inputs
from engine.quant.weight import QuantizedWeight
from kernels.cpu.row_library import RowKernelLibrary

PANEL_ROWS = 4096  # weight rows dequantized at once by the panel form (16 MiB of float32 at in=1024)
QUANT_FORMS = ("int", "panel")


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    lib: RowKernelLibrary,
    form: str,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x as int8 blocks, dequantized weight, bias)`` for x [rows, in] float32, in ``form``, into
    ``out`` ([rows, out_features], a column range of a wider tensor may be) or a new tensor."""
    if form == "int":
        return lib.linear(weight.type_name, x, weight.rows, weight.in_features, bias, out)
    x = kernel_inputs(weight.type_name, x, lib.act_terms)  # the int kernel's: both forms compute one function
    if out is None:
        out = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    for start in range(0, weight.out_features, PANEL_ROWS):
        count = min(PANEL_ROWS, weight.out_features - start)
        panel = lib.dequantize(weight.type_name, weight.rows, weight.in_features, start, count)  # [count, in]
        part = None if bias is None else bias[start : start + count]
        out[:, start : start + count] = F.linear(x, panel, part)
    return out


class QuantLinear(nn.Module):
    """A projection whose weight stays quantized: what a ``Linear`` of engine/model/cpu_linear.py is for
    float weights. ``per_bucket`` (a form per ``ROW_BUCKETS`` entry; past the last one, the last one's) is
    set by ``use_forms`` once timed; until then every row count takes ``int``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, lib: RowKernelLibrary):
        super().__init__()
        self.qweight = weight
        # registered even when None: a loader may put the bias after the weight (engine/model/loader.py)
        self.register_parameter(
            "bias", None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        )
        self.lib = lib
        self.per_bucket: tuple[str, ...] = ("int",) * len(ROW_BUCKETS)
        self.in_features, self.out_features = weight.in_features, weight.out_features
        # set by CausalLM.enable_lora, as on Linear: LoRA deltas on a quantized base are not wired yet
        self.lora_key: tuple[int, str] | None = None
        self.lora_ref = None

    def use_forms(self, per_bucket: tuple[str, ...]) -> None:
        assert len(per_bucket) == len(ROW_BUCKETS) and set(per_bucket) <= set(QUANT_FORMS), per_bucket
        self.per_bucket = per_bucket

    def form_for(self, rows: int) -> str:
        # Past the last timed bucket, its pick: the form that wins at 128 rows keeps winning at prefill
        # sizes (EPYC Zen 5, Q8_0 3072x576 at 128/256/512 rows: int 0.28/0.25/0.28 of panel's time),
        # where a fixed ``panel`` had prompts of 129+ tokens on a form 3-4x slower.
        bucket = min(bisect_left(ROW_BUCKETS, rows), len(self.per_bucket) - 1)
        return self.per_bucket[bucket]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = quantized_linear(x2, self.qweight, self.lib, self.form_for(x2.shape[0]), self.bias)
        if self.lora_ref is not None and self.lora_ref.step.groups:
            self.lora_ref.step.add_delta(self.lora_key, x2, y)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.qweight.type_name}, in={self.in_features}, out={self.out_features}"


def int_up_to(modules: list[QuantLinear], rows: int) -> None:
    """Every row bucket up to ``rows`` on the ``int`` form (the fused decode step's kernel), the timed
    picks past it kept: what ``MatmulForms.with_c_up_to`` is for float weights."""
    for m in modules:
        m.use_forms(tuple("int" if bucket <= rows else form for bucket, form in zip(ROW_BUCKETS, m.per_bucket)))
