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

from engine.quant.weight import BLOCKS, QuantizedWeight

_PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def weight_for(tensor: ReaderTensor) -> torch.Tensor | QuantizedWeight:
    """A 2-D tensor in a format with a C kernel (engine/quant/): its rows of blocks as they are in the file;
    anything else as float32, shape outermost first ([out_features, in_features] for a linear)."""
    if tensor.tensor_type.name in BLOCKS and len(tensor.shape) == 2:
        in_features = int(tensor.shape[0])
        rows = np.array(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1)  # a copy off the mmap
        return QuantizedWeight(tensor.tensor_type.name, torch.from_numpy(rows), in_features)
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
    plain = ", ".join(f"{k.name} x{n}" for k, n in counts.most_common() if k in _PLAIN)
    if all(k in _PLAIN for k in counts):
        return f"{plain} as stored"
    kept = ", ".join(f"{k.name} x{n}" for k, n in counts.most_common() if k.name in BLOCKS)
    other = ", ".join(f"{k.name} x{n}" for k, n in counts.most_common() if k not in _PLAIN and k.name not in BLOCKS)
    return (
        f"{kept or 'nothing'} kept quantized for the C kernels (engine/quant/; the embedding is dequantized, "
        f"fused parts of mixed formats too); {other or 'nothing'} dequantized to float32 at load; "
        f"{plain or 'nothing'} as stored"
    )
