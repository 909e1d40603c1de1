"""Random GGUF weight rows of each quantized type for the kernel tests: random bytes are valid blocks once
their float16 scale fields hold finite, moderate values, so every bit pattern of the quants is exercised
and ``gguf.quants.dequantize`` of the same bytes is an independent reference."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# per type: the byte offsets of float16 fields inside one block
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_rows(type_name: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[out, row_bytes] uint8: ``out`` rows of ``in`` values in ``type_name``'s blocks."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert in_features % block == 0
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scale = rng.uniform(0.2, 1.0, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]) / 64
        if type_name in ("Q4_K",):  # d and dmin are positive in llama.cpp's K-quants
            scale = np.abs(scale)
        blocks[:, :, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)


def activation_bound(x: np.ndarray, w: np.ndarray, terms: int = 1) -> np.ndarray:
    """[rows, out]: the most the kernels' rounding of x [rows, in] can move x @ w.T (w [out, in]). They
    round each block of 16 to int8 at amax / 127 steps (llama.cpp's blocks are 32), which moves a value by
    at most half a step, amax / 254. With two terms what that left is rounded the same way: its block max is
    at most amax / 254, so it leaves at most amax / 254 / 254 per value, plus float32's rounding of the
    residual and of the sum (an ulp of x). Times |w|."""
    blocks = np.abs(x.reshape(x.shape[0], -1, 16))
    amax = blocks.max(axis=2, keepdims=True)
    per_value = np.broadcast_to(amax / 254, blocks.shape) if terms == 1 else amax / 254 / 254 + blocks * 2.0**-23
    return per_value.reshape(x.shape) @ np.abs(w).T
