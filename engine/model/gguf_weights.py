"""The one decision of how a GGUF tensor becomes a weight the model runs.

Today every type is dequantized at load to float32 with ``gguf.quants.dequantize`` (llama.cpp's own
reference decoding), which the model then casts to its dtype. When the quantized kernels
(``engine/quant/``) land, types that have a kernel return their quantized record here instead, rows of
raw GGUF blocks, and this function is the one place that changes; the dequantizing path stays for the
types without a kernel. ``describe`` is the one log line saying which types were dequantized.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor, dequantize

_PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def weight_for(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as float32, shape outermost first ([out_features, in_features] for a linear)."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf package cannot decode"
        ) from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    # a copy: F32 tensors come back as read-only views of the memory-mapped file
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def describe(tensors: list[ReaderTensor]) -> str:
    """'Q4_1 x210, Q8_0 x1 dequantized to float32 at load; F32 x61 as stored' for the log."""
    counts = Counter(t.tensor_type for t in tensors)
    quantized = ", ".join(f"{k.name} x{n}" for k, n in counts.most_common() if k not in _PLAIN)
    plain = ", ".join(f"{k.name} x{n}" for k, n in counts.most_common() if k in _PLAIN)
    if not quantized:
        return f"{plain} as stored"
    return f"{quantized} dequantized to float32 at load (no quantized kernel wired yet); {plain or 'nothing'} as stored"
