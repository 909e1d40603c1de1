"""The int8 KV cache's row format (``--kv-cache-dtype int8``) and its torch quantizer.

One token's one KV head is a row of ``head_dim`` int8 values followed by its float32 scale, the 4
bytes packed into the same int8 row: ``[head_dim values | scale]``, so a pool block holds its scales
and every transport moves it as it is (no second tensor to keep in step). Symmetric, per token per
head: ``scale = amax / 127``, ``q = round(x * (127 / amax))`` (round half to even), clamped to
[-127, 127]; an all-zero row keeps scale 0. The C store (kernels/cpu/layer_ops.c) computes the same
float32 operations, so both produce the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row
QMAX = 127.0


def row_dim(head_dim: int) -> int:
    """int8 elements of one packed row; head_dim must keep the scale 4-byte aligned."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"int8 KV cache needs head_dim divisible by {SCALE_BYTES}, not {head_dim}")
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] int8 packed rows."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    scale = amax / QMAX
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim + 4] int8 -> [..., 1] float32 (a view where the rows are contiguous)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    tail = rows[..., head_dim:]
    if tail.stride(-1) != 1 or any(s % SCALE_BYTES for s in tail.stride()[:-1]):
        tail = tail.contiguous()
    return tail.view(torch.float32)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., head_dim + 4] int8 -> [..., head_dim] ``dtype``: values times their row's scale."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :head_dim].float() * scales(rows)).to(dtype)
