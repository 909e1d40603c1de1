"""Q4_K and Q6_K blocks made from float weights (the gguf package decodes them but has no quantizer): for
the tests' models and for writing K-quant weights without llama.cpp. A plain scheme, not llama.cpp's
error-minimising search: each sub-block's scale (and Q4_K's min) from its range, the super-block's float16
scale from the largest of them. Layouts: kernels/cpu/quant.c's header."""

from __future__ import annotations

import numpy as np
import torch

from engine.quant.weight import QuantizedWeight


def quantize_q6_k(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] float (``in`` a multiple of 256) as Q6_K rows: int8 scale per 16 values, 6-bit quants."""
    w = weight.detach().double().numpy().reshape(-1, 16, 16)  # [super-blocks, 16 sub-blocks, 16 values]
    amax_at = np.take_along_axis(w, np.abs(w).argmax(axis=2)[..., None], axis=2)[..., 0]
    sub = -amax_at / 32  # signed, as llama.cpp: the largest value lands on -32
    d = (np.abs(sub).max(axis=1) / 127).astype(np.float16)  # [sb]
    d32 = d.astype(np.float64)
    # rounded away from zero: the stored scale never falls short of the sub-block's range (a short one
    # would clip its largest values by up to sc / |sc| steps)
    ratio = sub / np.where(d32 > 0, d32, 1)[:, None]
    sc = np.clip(np.sign(ratio) * np.ceil(np.abs(ratio)), -127, 127)  # [sb, 16]
    step = d32[:, None, None] * sc[..., None]
    q = np.clip(np.round(w / np.where(step != 0, step, 1)), -32, 31).astype(np.int64) + 32  # 0..63
    q = q.reshape(-1, 2, 4, 32)  # [sb, half, group of 32, l]: value 128 h + 32 g + l
    ql = np.empty((q.shape[0], 2, 64), dtype=np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = sum((q[:, :, g] >> 4) << (2 * g) for g in range(4)).astype(np.uint8)  # [sb, 2, 32]
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), d.reshape(-1, 1).view(np.uint8)],
        axis=1,
    )
    return _record("Q6_K", blocks, weight.shape)


def quantize_q4_k(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] float (``in`` a multiple of 256) as Q4_K rows: 6-bit scale and min per 32 values, 4-bit quants."""
    w = weight.detach().double().numpy().reshape(-1, 8, 32)  # [super-blocks, 8 sub-blocks, 32 values]
    low = np.minimum(w.min(axis=2), 0)  # [sb, 8], the min subtracted
    scale = (w.max(axis=2) - low) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-low.min(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.int64)
    m = np.clip(np.round(-low / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.int64)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round((w + (dmin32 * m)[..., None]) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    scales = np.zeros((w.shape[0], 12), dtype=np.uint8)  # ggml's get_scale_min_k4, inverted
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low nibbles, 2c + 1 high
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs], axis=1)
    return _record("Q4_K", blocks, weight.shape)


def _record(type_name: str, blocks: np.ndarray, shape: torch.Size) -> QuantizedWeight:
    out_features, in_features = shape
    rows = torch.from_numpy(np.ascontiguousarray(blocks).reshape(out_features, -1))
    return QuantizedWeight(type_name, rows, in_features)
