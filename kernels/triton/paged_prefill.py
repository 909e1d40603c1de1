"""Chunked-prefill attention: a varlen batch of query chunks over each request's paged KV.

Request i's chunk is the last q_len_i tokens of its context_lens[i]-token context (whose K/V are already
in the pool): query j sits at position ``ctx_i - q_len_i + j`` and sees keys ``0 ..= pos``, i.e. the
cached prefix plus the causal part of its own chunk. This is paged_attention's general contract.

On CPU the C kernel (kernels/cpu/prefill.c; kv_int8_ops.c for an int8 pool; ``NativePrefill``) takes
the chunks where the engine asks for it; the torch reference runs SDPA request by request over the gathered context.

Triton: one program per (request, tile of BLOCK_M queries, kv head). The tile's rows are
(query, head of the group) pairs, so each KV tile is loaded once for the whole query group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu.kv_int8 import int8_kernels
from kernels.cpu.native import NativeLibrary
from kernels.triton.attention_tile import kv_tile_format, load_kv_tile, online_softmax_step
from kernels.triton.paged_decode import checked_tables, gather_context
from kernels.triton.triton_or_stub import tl, triton

_LOG2E = 1.4426950408889634
_ROWS = 64  # (query, group head) rows per program
_BLOCK_N = 64  # KV tokens per tile


@dataclass(slots=True)
class NativePrefill:
    """A step's prefill chunks for the C kernel: their inputs, converted once per step."""

    library: NativeLibrary
    block_tables: torch.Tensor  # [p, max_blocks] int64, contiguous, every id in the pool
    context_lens: torch.Tensor  # [p] int64
    query_start_loc: torch.Tensor  # [p + 1] int64

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if k_cache.dtype == torch.int8:  # --kv-cache-dtype int8: dequantized a key tile at a time (kv_int8_ops.c)
            return int8_kernels(self.library).prefill(
                q, k_cache, v_cache, self.block_tables, self.context_lens, self.query_start_loc, scale
            )
        return self.library.paged_prefill(
            q, k_cache, v_cache, self.block_tables, self.context_lens, self.query_start_loc, scale
        )


def plan_prefill(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache: torch.Tensor,
    native: NativeLibrary | None,
) -> NativePrefill | None:
    """The chunks' inputs for the C kernel (``cache``: any one layer's K cache, for its block count);
    None where there is no kernel (SDPA then)."""
    if native is None:
        return None
    tables = checked_tables(block_tables, cache)
    return NativePrefill(native, tables, context_lens.long().contiguous(), query_start_loc.long().contiguous())


def prefill_rows(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, native: NativePrefill | None):
    """The C kernel where the plan holds one, else the torch reference."""
    if native is not None:
        return native.run(q, k_cache, v_cache, scale)
    return paged_prefill_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)


def paged_prefill_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """q: [num_tokens, heads, d]; other arguments as in paged_attention. Returns [num_tokens, heads, d].

    One SDPA call per request: padding chunks of different lengths to one [max_q, max_ctx] box cost
    twice the arithmetic on a typical mixed step (measured), and a prefill step holds few requests.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        q_len = end - start
        k = gather_context(k_cache, block_tables[i : i + 1], ctx).transpose(1, 2)  # [1, kvh, ctx, d]
        v = gather_context(v_cache, block_tables[i : i + 1], ctx).transpose(1, 2)
        if q_len == ctx:  # a first chunk: plain causal, which SDPA computes without the masked half
            mask, causal = None, True
        else:  # query j sits at ctx - q_len + j and sees keys 0 ..= that position
            positions = torch.arange(ctx - q_len, ctx, device=q.device)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None], False
        chunk = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )  # [1, heads, q_len, d]
        out[start:end] = chunk[0].transpose(0, 1)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,  # q, out: [num_tokens, num_heads, head_dim]
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,  # caches: [num_blocks, block_size, kv_heads, head_dim]
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt_b,
    stride_bt_i,  # block_tables: [batch, max_blocks]
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    COMPUTE: tl.constexpr,  # KVTileFormat (attention_tile.py): the tiles' dtype, int8 rows, values per scale
    KV_INT8: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)

    r = tl.arange(0, BLOCK_M * GROUP_PAD)  # row = (query m of the tile, head g of the group)
    m = tile * BLOCK_M + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    row_ok = (m < q_len) & (g < GROUP)
    d_ok = d < HEAD_DIM
    q_pos = ctx - q_len + m  # [ROWS] absolute position of each row's query
    token = (q_start + m).to(tl.int64)
    head = kvh * GROUP + g
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, tl.float32)  # finite so padded rows never give NaN
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # last query of the tile sees up to here
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < kv_end
        k, v = load_kv_tile(
            k_ptr,
            v_ptr,
            block_tables_ptr + b * stride_bt_b,
            t,
            t_ok,
            d,
            d_ok,
            kvh,
            stride_bt_i,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            PAGE_SIZE,
            COMPUTE,
            KV_INT8,
            HEAD_DIM,
            GROUP_SIZE,
        )  # each [BLOCK_N, DIM_PAD], loaded once for the whole group
        visible = t_ok[None, :] & (t[None, :] <= q_pos[:, None])  # [ROWS, BLOCK_N]: causal within the chunk
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, UPCAST)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_triton(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, rows=_ROWS, block_n=_BLOCK_N, out=None
):
    """``rows``/``block_n`` override the tile sizes (tests); ``out`` lets a test pass a poisoned buffer."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, page_size, kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    assert num_heads % kv_heads == 0, (q.shape, k_cache.shape)
    upcast = q.dtype == torch.float32 or not q.is_cuda  # the CPU interpreter cannot dot bf16
    kv = kv_tile_format(q, k_cache, upcast)
    assert v_cache.shape == k_cache.shape and context_lens.shape == (batch,) and query_start_loc.shape == (batch + 1,)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert query_start_loc.is_contiguous() and context_lens.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0 or num_tokens == 0:
        return out
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, rows // group_pad)
    assert block_m * group_pad >= 16 and block_n >= 16, "tl.dot needs at least 16 rows and columns"
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # one sync: sizes the grid
    _prefill_kernel[(batch, triton.cdiv(max_q, block_m), kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        query_start_loc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        UPCAST=upcast,
        COMPUTE=kv.compute,
        KV_INT8=kv.kv_int8,
        GROUP_SIZE=kv.group_size,
    )
    return out
