"""``--quantization int8``: per-output-channel, weight-only int8 made at load from float weights (vLLM's
flag; the scheme of its CPU W8A8 path without the activation side). Each row keeps its own scale
``max|w| / 127``, so one large row does not coarsen the others; the kernel reads the row as
``[float32 scale | int8 q[in]]`` (kernels/cpu/quant.c, type I8)."""

from __future__ import annotations

import torch

from engine.quant.weight import QuantizedWeight


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` [out, in] (any float dtype; ``in`` a multiple of 32) as per-channel int8 rows."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / 127  # [out]
    q = torch.round(w / torch.where(scale > 0, scale, 1).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    rows = torch.cat([scale.unsqueeze(1).contiguous().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantizedWeight("I8", rows.contiguous(), w.shape[1])


def dequantize_int8(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 [out, in] values the kernel multiplies by (for tests and the prefill panel's reference)."""
    assert weight.type_name == "I8"
    scale = weight.rows[:, :4].contiguous().view(torch.float32)  # [out, 1]
    return weight.rows[:, 4:].contiguous().view(torch.int8).to(torch.float32) * scale
