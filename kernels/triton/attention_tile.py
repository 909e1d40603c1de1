"""Tile steps shared by the decode and chunked-prefill attention kernels (Triton device functions).

A KV tile is BLOCK_N consecutive token positions of one request, which may span several pages; each
token's page comes from the block table, so the tile is a gather of ``[BLOCK_N, head_dim]`` rows of one
KV head. The softmax is online and in base 2 (scores pre-multiplied by scale * log2(e)).

The pool may hold the model's float type, e4m3 (``--kv-cache-dtype fp8``) or packed int8 rows
(``int8``); ``kv_tile_format`` reads which from the cache, and ``load_kv_tile`` returns the tile in
the compute dtype either way: no kernel ever dequantizes more than the tile it is working on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton import kv_int8
from kernels.triton.triton_or_stub import tl, triton

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)


@dataclass(frozen=True, slots=True)
class KVTileFormat:
    """What the attention kernels need to know about a pool's rows (their constexpr arguments)."""

    kv_int8: bool
    group_size: int  # int8 values per scale; 1 for float pools (unused)
    compute: object  # tl dtype the tiles are returned in


def kv_tile_format(q: torch.Tensor, k_cache: torch.Tensor, upcast: bool) -> KVTileFormat:
    """The launchers' check of the pool against the queries: ``[..., head_dim]`` rows of a float or
    e4m3 pool, or ``[..., kv_int8.row_dim(head_dim)]`` packed int8 rows."""
    head_dim, row = q.shape[-1], k_cache.shape[-1]
    assert k_cache.dtype in KV_DTYPES, f"no attention kernel reads a {k_cache.dtype} KV pool"
    is_int8 = k_cache.dtype == torch.int8
    assert row == (kv_int8.row_dim(head_dim) if is_int8 else head_dim), (q.shape, k_cache.shape, k_cache.dtype)
    compute = tl.float32 if upcast else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype]
    return KVTileFormat(is_int8, kv_int8.group_size(head_dim) if is_int8 else 1, compute)


@triton.jit
def load_kv_tile(
    k_ptr,
    v_ptr,
    table_ptr,  # table_ptr: this request's row of the block table
    t,
    t_ok,
    d,
    d_ok,
    kv_head,  # t: [BLOCK_N] token positions, d: [DIM_PAD] feature indices
    stride_table,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE_SIZE: tl.constexpr,
    COMPUTE: tl.constexpr,  # the dtype the tile is returned in (float32, or the queries' half type)
    KV_INT8: tl.constexpr,  # packed int8 rows (kv_int8.py): dequantized here, in registers
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # int8 values per scale
):
    page = tl.load(table_ptr + (t // PAGE_SIZE) * stride_table, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE_SIZE
    mask = t_ok[:, None] & d_ok[None, :]
    k_row = k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh  # [BLOCK_N, 1]
    v_row = v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
    k = tl.load(k_row + d[None, :], mask=mask, other=0.0)  # [BLOCK_N, DIM_PAD]
    v = tl.load(v_row + d[None, :], mask=mask, other=0.0)
    if KV_INT8:  # this tile only: values times their group's scale
        k = kv_int8.dequantize_tile(k_row, k, d, mask, HEAD_DIM, GROUP_SIZE)
        v = kv_int8.dequantize_tile(v_row, v, d, mask, HEAD_DIM, GROUP_SIZE)
    return k.to(COMPUTE), v.to(COMPUTE)  # fp8 (e4m3) upcasts here


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """q: [ROWS, D]; k, v: [BLOCK_N, D]; visible: [ROWS, BLOCK_N]. Returns the updated (m_i, l_i, acc).

    m_i starts at a finite -1e30 rather than -inf so a row with nothing visible yet stays NaN-free.
    """
    if UPCAST:  # fp32 inputs get full fp32 products (no TF32); the interpreter cannot dot bf16
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
