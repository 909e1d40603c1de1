"""A fused projection whose parts are quantized in different formats, each part on its own kernel.

llama.cpp's Q4_K_M picks a format per tensor, so a fused projection's parts may differ: on SmolLM2 14 of
the 30 layers have q/k in Q5_0 and v in Q8_0. Dequantized, such a projection is float32 (2.2 MB a step
for SmolLM2's qkv instead of 0.7 MB); here each run of same-format parts stays one ``QuantLinear`` and
writes its own columns of the one output, so the layer sees one projection, as before. The fused decode
step runs it as two kernel calls (kernels/cpu/decode_step.h's split ``Projection``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.linear import QuantLinear, quantized_linear
from engine.quant.weight import QuantizedWeight, concat_rows
from kernels.cpu.quant import QuantLibrary

MAX_RUNS = 2  # format runs the fused decode step's Projection holds (kernels/cpu/decode_step.h)


def format_runs(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts with each run of neighbours in one format joined (q, k in Q5_0 and v in Q8_0: two)."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].type_name == part.type_name:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else concat_rows(run) for run in runs]


class QuantParts(nn.Module):
    """``x @ W^T + bias`` for W the rows of ``runs`` in order, each run a ``QuantLinear`` in its format
    (its form timed as any other's: engine/quant/forms.py), the bias the whole projection's."""

    def __init__(self, runs: list[QuantizedWeight], bias: torch.Tensor | None, lib: QuantLibrary):
        super().__init__()
        if not 1 < len(runs) <= MAX_RUNS or len({r.in_features for r in runs}) != 1:
            found = ", ".join(f"{r.type_name} [{r.out_features}, {r.in_features}]" for r in runs)
            raise ValueError(f"a split projection takes 2..{MAX_RUNS} runs of one width; got {found}")
        self.runs = nn.ModuleList(QuantLinear(r, None, lib) for r in runs)
        self.register_parameter(
            "bias", None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        )
        self.in_features = runs[0].in_features
        self.out_features = sum(r.out_features for r in runs)
        self.starts = [sum(r.out_features for r in runs[:i]) for i in range(len(runs))]  # each run's first column
        self.lora_key: tuple[int, str] | None = None  # set by CausalLM.enable_lora, as on QuantLinear
        self.lora_ref = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        for run, start in zip(self.runs, self.starts):
            end = start + run.out_features
            bias = None if self.bias is None else self.bias[start:end]
            quantized_linear(x2, run.qweight, run.lib, run.form_for(x2.shape[0]), bias, y[:, start:end])
        if self.lora_ref is not None and self.lora_ref.step.groups:
            self.lora_ref.step.add_delta(self.lora_key, x2, y)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        formats = "+".join(f"{r.qweight.type_name}x{r.out_features}" for r in self.runs)
        return f"{formats}, in={self.in_features}, out={self.out_features}"
