"""The activations each weight format's C kernel multiplies, as float32: what the ``panel`` form
(engine/quant/linear.py) must multiply too, so both forms compute one function and the timed pick per
row count never changes the output.

- the GGUF block formats and I8: x in int8 blocks of 16, and with ``terms`` 2 (``model.quant_activations:
  int16``) plus what that rounding left, rounded again (act_blocks.py, kernels/cpu/quant.c);
- BF16: x split into two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), each rounded to nearest even
  and a denormal half read as zero (vdpbf16ps's reading), so x to 16 significant bits
  (kernels/cpu/half.c's opening comment says why not llama.cpp's single rounding);
- F16: x itself (the weights are widened to float32 and meet x in float32 FMAs).
"""

from __future__ import annotations

import torch

from engine.quant.act_blocks import as_int8_terms

_SMALLEST_NORMAL = 2.0**-126


def _bf16(v: torch.Tensor) -> torch.Tensor:
    r = v.to(torch.bfloat16).float()
    return r.masked_fill(r.abs() < _SMALLEST_NORMAL, 0.0)


def as_bf16_halves(x: torch.Tensor) -> torch.Tensor:
    """hi + lo for float32 x: exact in float32, since lo sits below hi's last bit."""
    hi = _bf16(x)
    return hi + _bf16(x - hi)


def kernel_inputs(type_name: str, x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """x [rows, in] float32 as ``type_name``'s kernel reads it; ``terms``: the block formats' int8 terms."""
    if type_name == "BF16":
        return as_bf16_halves(x)
    if type_name == "F16":
        return x
    return as_int8_terms(x, terms)
