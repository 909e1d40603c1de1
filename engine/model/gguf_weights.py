"""The one decision of how a GGUF tensor becomes a weight the model runs.

A 2-D tensor in a format the C kernels run (engine/quant/weight.py's BLOCKS: Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q6_K in kernels/cpu/quant.c; F16 and BF16 in kernels/cpu/half.c) stays as the file holds it:
``weight_for`` returns its raw rows (blocks, or 16-bit values) as a ``QuantizedWeight``
(engine/model/gguf_quant.py puts those into the model's projections), so a BF16 file streams 2 bytes a
weight, not a float32 copy's 4. Every other type (F32, Q5_K, Q2_K, ...) is dequantized to float32 with
``gguf.quants.dequantize`` (llama.cpp's reference decoding), which the model then casts to its dtype; the
load log says which took which path.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from gguf import ReaderTensor, dequantize

from engine.quant.weight import BLOCKS, QuantizedWeight


def weight_for(tensor: ReaderTensor) -> torch.Tensor | QuantizedWeight:
    """A quantized record where a kernel runs the format, else the float32 tensor ([out, in] first)."""
    if tensor.tensor_type.name in BLOCKS and len(tensor.shape) == 2:
        # a copy off the mmap, as bytes: [out, row bytes] (the reader hands F16 tensors out as float16 values)
        rows = torch.from_numpy(np.array(tensor.data).view(np.uint8))
        return QuantizedWeight(tensor.tensor_type.name, rows, int(tensor.shape[0]))
    return dequantized(tensor)


def dequantized(tensor: ReaderTensor) -> torch.Tensor:
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
    """'Q4_1 x210, F32 x61, Q8_0 x1': the file's tensor types, for the log."""
    counts = Counter(t.tensor_type.name for t in tensors)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())
