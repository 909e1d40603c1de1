"""The int8 KV cache's row format (``--kv-cache-dtype int8``) and its torch quantizer.

One token's one KV head is a row of ``head_dim`` int8 values followed by one float16 scale per group
of 16 values (``GROUP``; a head of 16 or fewer values is one group), the scales' bytes packed into the
same int8 row: ``[head_dim values | scales]``. A pool block therefore holds its scales and every
transport moves it as it is (no second tensor to keep in step).

Symmetric, per token, per head, per group: ``scale = float16(amax / 127)``, ``q = round(x * (1 /
scale))`` (round half to even), clamped to [-127, 127]: the values are rounded against the scale that
is stored, so a scale's own rounding never shifts them; a group whose scale is 0 in float16 (all zero,
or below float16's range) stores zeros.

Why 16 values in float16, not 32 in float32 (llama.cpp's q8_0 block): the same bytes (72 a row at
head_dim 64, 0.28x float32's, 3.56x the tokens), and the keys' error is what moves the output. On
SmolLM2-135M, mean KL divergence from float32 KV over the same windows: groups of 32 with float32
scales 0.00055 (1k) / 0.00047 (4k), groups of 16 with float16 scales 0.00033 / 0.00028, llama.cpp's
q8_0 0.00033 / 0.00039 (docs/benchmarks.md). One scale per 64-value head was worse again. The C
kernels (kernels/cpu/int8_rows.h, kv_int8_ops.c, decode_int8.c) read and write the same format.
"""

from __future__ import annotations

import torch

from kernels.triton.triton_or_stub import tl, triton

GROUP = 16  # values per scale
SCALE_BYTES = 2  # one float16 per group
QMAX = 127.0
F16_MAX = 65504.0  # a larger amax / 127 (|x| past 8.3 million) keeps float16's largest scale, clamped


def group_size(head_dim: int) -> int:
    return min(GROUP, head_dim)


def row_dim(head_dim: int) -> int:
    """int8 elements of one packed row; the scales must stay 2-byte aligned and the groups whole."""
    if head_dim % SCALE_BYTES or head_dim % group_size(head_dim):
        raise ValueError(f"int8 KV cache needs head_dim divisible by {SCALE_BYTES} and by {GROUP} past {GROUP}")
    return head_dim + SCALE_BYTES * (head_dim // group_size(head_dim))


def head_dim_of(row: int) -> int:
    """The inverse of row_dim: one group up to GROUP values, else SCALE_BYTES of scale per GROUP values."""
    head_dim = row - SCALE_BYTES if row <= GROUP + SCALE_BYTES else row * GROUP // (GROUP + SCALE_BYTES)
    if head_dim <= 0 or row_dim(head_dim) != row:
        raise ValueError(f"no head_dim packs into an int8 row of {row}")
    return head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., row_dim(head_dim)] int8 packed rows."""
    head_dim = x.shape[-1]
    gs = group_size(head_dim)
    row_dim(head_dim)  # checks the shape
    x32 = x.float().reshape(*x.shape[:-1], head_dim // gs, gs)
    amax = x32.abs().amax(-1, keepdim=True)
    scale = (amax / QMAX).clamp_(max=F16_MAX).half()  # [..., groups, 1]; RNE, as the C store's _Float16
    d = scale.float()
    # tensor by tensor: torch.reciprocal is not IEEE division, and C's 1.0f / d is
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(x32 * inv).clamp_(-QMAX, QMAX).to(torch.int8).reshape(x.shape)
    return torch.cat([q, scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """[..., row] int8 -> [..., groups] float32, from the float16 scales."""
    head_dim = head_dim_of(rows.shape[-1])
    tail = rows[..., head_dim:]
    if tail.stride(-1) != 1 or any(s % SCALE_BYTES for s in tail.stride()[:-1]) or tail.storage_offset() % 2:
        tail = tail.contiguous()
    return tail.view(torch.float16).float()


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., row] int8 -> [..., head_dim] ``dtype``: values times their group's scale."""
    head_dim = head_dim_of(rows.shape[-1])
    gs = group_size(head_dim)
    values = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // gs, gs)
    return (values * scales(rows)[..., None]).reshape(*rows.shape[:-1], head_dim).to(dtype)


@triton.jit
def quantize_groups(x):
    """x: [heads, groups, GROUP_PAD] float32 (padding zero) -> (values int8 like x, scales float16 [heads, groups]).

    quantize_rows in Triton, bit for bit: IEEE divisions (``div_rn``; Triton's ``/`` may approximate),
    and round half to even done by hand from ``floor`` (the interpreter has no ``rint``). Launch with
    ``enable_fp_fusion=False``: an FMA of ``x * inv - floor(..)`` would see the unrounded product and
    decide ties differently from torch.
    """
    amax = tl.max(tl.abs(x), axis=2)
    scale = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)  # F16_MAX, QMAX
    d = scale.to(tl.float32)
    inv = tl.where(d > 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0, d, 1.0)), 0.0)
    # clamping before rounding gives round-then-clamp's result: |y| past 127 rounds to 127 or beyond
    y = tl.clamp(x * inv[:, :, None], -127.0, 127.0)
    low = tl.floor(y)
    frac = y - low  # exact: |y| <= 127
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, low + 1.0, low).to(tl.int8), scale


@triton.jit
def dequantize_tile(row, values, d, mask, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """row: [N, 1] int8 pointers to packed rows; values: their [N, DIM_PAD] int8 values at columns d.
    Returns float32 values times their group's float16 scale, read from the row's tail."""
    # 2: SCALE_BYTES (a jitted function reads only constexpr globals)
    scale_ptr = (row + HEAD_DIM + 2 * (d[None, :] // GROUP_SIZE)).to(tl.pointer_type(tl.float16))
    scale = tl.load(scale_ptr, mask=mask, other=0.0).to(tl.float32)
    return values.to(tl.float32) * scale
