"""The int8 KV cache's row format (``--kv-cache-dtype int8``) and its torch quantizer.

One token's one KV head is a row of ``head_dim`` int8 values followed by one float32 scale per group
of 32 values (``GROUP``; a head of 32 or fewer values is one group), the scales' bytes packed into the
same int8 row: ``[head_dim values | scales]``. A pool block therefore holds its scales and every
transport moves it as it is (no second tensor to keep in step).

Symmetric, per token, per head, per group: ``scale = amax / 127``, ``q = round(x * (127 / amax))``
(round half to even), clamped to [-127, 127]; an all-zero group keeps scale 0. Groups of 32 are
llama.cpp's q8_0 block: with one scale per 64-value head (SmolLM2-135M) the measured agreement with
float32 KV fell short of q8_0's (docs/benchmarks.md); two scales cost 4 bytes a row more (72 bytes
against float32's 256: 0.28x, 3.56x the tokens). The C decode kernel (kernels/cpu/decode_int8.c)
reads the same format.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale
SCALE_BYTES = 4  # one float32 per group
QMAX = 127.0


def group_size(head_dim: int) -> int:
    return min(GROUP, head_dim)


def row_dim(head_dim: int) -> int:
    """int8 elements of one packed row; the scales must stay 4-byte aligned and the groups whole."""
    if head_dim % SCALE_BYTES or head_dim % group_size(head_dim):
        raise ValueError(f"int8 KV cache needs head_dim divisible by {SCALE_BYTES} and by {GROUP} past {GROUP}")
    return head_dim + SCALE_BYTES * (head_dim // group_size(head_dim))


def head_dim_of(row: int) -> int:
    """The inverse of row_dim: one group up to GROUP values, else 4 bytes of scale per GROUP values."""
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
    limit = torch.full_like(amax, QMAX)
    # tensor by tensor: ``QMAX / amax`` would be torch's reciprocal times 127, a float away from the C
    # kernels' 127 / amax in a quarter of the groups, which moves a value landing on a half (8.5 -> 8 or 9)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv).clamp_(-QMAX, QMAX).to(torch.int8).reshape(x.shape)
    scale = (amax / QMAX).squeeze(-1).contiguous()  # [..., groups]
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """[..., row] int8 -> [..., groups] float32 (a view where the rows allow it)."""
    head_dim = head_dim_of(rows.shape[-1])
    tail = rows[..., head_dim:]
    if tail.stride(-1) != 1 or any(s % SCALE_BYTES for s in tail.stride()[:-1]) or tail.storage_offset() % 4:
        tail = tail.contiguous()
    return tail.view(torch.float32)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., row] int8 -> [..., head_dim] ``dtype``: values times their group's scale."""
    head_dim = head_dim_of(rows.shape[-1])
    gs = group_size(head_dim)
    values = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // gs, gs)
    return (values * scales(rows)[..., None]).reshape(*rows.shape[:-1], head_dim).to(dtype)
