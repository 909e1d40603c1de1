"""Decode attention: one query token per request over its paged KV (the q_len == 1 case of paged_attention).

Triton: one program per (request, kv head, split). It loads each KV tile once and scores the whole
query group of that KV head against it (GQA), keeping an online softmax. Long contexts are cut into
``num_splits`` ranges run in parallel (split-K); a second kernel merges the partial results by their
log-sum-exp. The torch reference is the engine's CPU decode path: batched matmuls per KV head over
the gathered context (GQA without repeat_interleave).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.kv_int8 import int8_kernels
from kernels.cpu.native import NativeLibrary
from kernels.triton import kv_int8
from kernels.triton.attention_tile import kv_tile_format, load_kv_tile, online_softmax_step
from kernels.triton.triton_or_stub import tl, triton

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the extra parallelism
_BLOCK_N = 64  # KV tokens per tile (may span several pages)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_ctx: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim] -> [batch, max_ctx, kv_heads, head_dim]
    num_blocks = -(-max_ctx // cache.shape[1])
    ids = block_tables[:, :num_blocks].reshape(-1).long()  # [batch * num_blocks]
    return _gather(cache, ids, block_tables.shape[0], max_ctx)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, max_ctx: int) -> torch.Tensor:
    # One row per block: index_select copies whole rows with memcpy (measured 3x faster than on 4-D).
    rows = cache.view(cache.shape[0], -1) if cache.is_contiguous() else cache
    gathered = rows.index_select(0, block_ids)  # [batch * num_blocks, block_size * kvh * d]
    context = gathered.view(batch, -1, *cache.shape[2:])[:, :max_ctx]
    if cache.dtype == torch.int8:  # these requests' rows only, never the whole pool (kv_int8.py)
        return kv_int8.dequantize_rows(context)
    return context


# CPU decode buckets: requests of similar context length, padded together. A bucket holds as many rows
# as keep its gathered K and V within _BUCKET_BYTES (one core's L2 here), so the bmm that reads them
# next finds them in cache; short contexts fill up to _MAX_ROWS_PER_BUCKET rows, where fewer, smaller
# calls would cost more in per-call overhead than the cache saves. Whole decode steps of the small model
# (~0.6 MB of K+V a row at 600 tokens), 2026-11-24 Xeon, 4 rows a bucket against 16: one thread 3-7%
# faster at batch 8-32 with 64-512-token prompts, two threads within 1% at batch 16-64; with 16-64-token
# prompts, 4 rows cost two threads 6% at batch 64 (hence the byte budget, not a fixed row count).
_BUCKET_BYTES = 2 << 20
_MAX_ROWS_PER_BUCKET = 16


@dataclass(slots=True)
class DecodeBucket:
    """Requests of similar context length, attended together padded to the longest of them."""

    rows: torch.Tensor | None  # [r] the batch rows in this bucket; None: every row, in order
    block_ids: torch.Tensor  # [r * blocks] int64: each row's first ceil(max_ctx / block_size) blocks
    max_ctx: int
    padding: torch.Tensor  # [r, 1, max_ctx] bool: True past a row's context


@dataclass(slots=True)
class NativeDecode:
    """A step's decode rows for the C kernel (kernels/cpu/decode.c): its inputs, converted once per step."""

    library: NativeLibrary
    block_tables: torch.Tensor  # [d, max_blocks] int64, contiguous
    context_lens: torch.Tensor  # [d] int64
    max_context: int

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if k_cache.dtype == torch.int8:  # --kv-cache-dtype int8: dequantized in registers (decode_int8.c)
            return int8_kernels(self.library).decode(
                q, k_cache, v_cache, self.block_tables, self.context_lens, self.max_context, scale
            )
        return self.library.paged_decode(
            q, k_cache, v_cache, self.block_tables, self.context_lens, self.max_context, scale
        )


def checked_tables(block_tables: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The block tables as the C kernels take them (int64, contiguous), every id checked to lie in the
    pool: the C code indexes the pool with them unchecked, so an id out of range must fail here."""
    tables = block_tables.long().contiguous()
    low, high = map(int, torch.aminmax(tables)) if tables.numel() else (0, 0)
    if low < 0 or high >= cache.shape[0]:
        raise IndexError(f"block table ids span {low}..{high}, pool has {cache.shape[0]} blocks")
    return tables


def plan_decode(
    block_tables: torch.Tensor, context_lens: torch.Tensor, cache: torch.Tensor, native: NativeLibrary | None = None
) -> list[DecodeBucket] | NativeDecode:
    """How the CPU decodes a step's rows: the C kernel when ``native`` is given (the caller checked it
    supports the model), else the torch path's buckets. Either depends on the step only, so the runner
    plans once per step and every layer reuses the plan (planning in each layer was ~5% of a decode
    step at batch 64). ``cache``: any one layer's K cache, for its block size and bytes per token."""
    if native is not None:
        tables = checked_tables(block_tables, cache)
        return NativeDecode(native, tables, context_lens.long().contiguous(), int(context_lens.max()))
    block_size = cache.shape[1]
    token_bytes = 2 * cache[0, 0].nbytes  # one token's K and its V in one layer
    order = torch.argsort(context_lens)
    sizes = bucket_sizes(context_lens.index_select(0, order).tolist(), token_bytes)
    groups = [None] if len(sizes) == 1 else order.split(sizes)
    buckets = []
    for rows in groups:
        tables = block_tables if rows is None else block_tables.index_select(0, rows)
        lens = context_lens if rows is None else context_lens.index_select(0, rows)
        max_ctx = int(lens.max())
        ids = tables[:, : -(-max_ctx // block_size)].reshape(-1).long()
        padding = torch.arange(max_ctx, device=lens.device)[None, None, :] >= lens[:, None, None]
        buckets.append(DecodeBucket(rows, ids, max_ctx, padding))
    return buckets


def bucket_sizes(sorted_lens: list[int], token_bytes: int) -> list[int]:
    """Rows of each bucket over context lengths sorted ascending: a bucket's K and V padded to its
    longest context (``token_bytes`` per token, K and V) stay within _BUCKET_BYTES, or it has one row."""
    sizes, rows = [], 0
    for length in sorted_lens:  # ascending: this length is the longest of the bucket so far
        if rows and (rows == _MAX_ROWS_PER_BUCKET or (rows + 1) * length * token_bytes > _BUCKET_BYTES):
            sizes.append(rows)
            rows = 0
        rows += 1
    return sizes + [rows]


def paged_decode_reference(
    q: torch.Tensor,  # [batch, num_heads, head_dim], request i's query is token context_lens[i] - 1
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    context_lens: torch.Tensor,  # [batch]
    scale: float,
    plan: list[DecodeBucket] | None = None,  # plan_decode(block_tables, context_lens, k_cache)
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """Requests sorted by context length go in buckets (see bucket_sizes), each padded only to its own
    longest context: a few batched calls, far less padding than one call padded to the batch's max."""
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache)
    if len(plan) == 1 and plan[0].rows is None:
        return _decode_bucket(q, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(q)
    for bucket in plan:
        out.index_copy_(0, bucket.rows, _decode_bucket(q.index_select(0, bucket.rows), k_cache, v_cache, bucket, scale))
    return out


def _decode_bucket(q, k_cache, v_cache, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    """Batched matmuls per KV head on the gathered context, read in place through strided views.

    With one query row per request, SDPA's CPU flash kernel is ~3x slower than two bmm calls and a
    softmax here (its tiling is built for many query rows), so decode does the arithmetic itself.
    """
    batch, num_heads, head_dim = q.shape
    dtype = q.dtype
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    k = _gather(k_cache, bucket.block_ids, batch, bucket.max_ctx)  # [b, ctx, kvh, d]
    v = _gather(v_cache, bucket.block_ids, batch, bucket.max_ctx)
    compute = torch.float32  # softmax statistics in fp32 whatever the cache dtype
    if k.dtype != compute:
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    q = q * scale  # scaling the [b, heads, d] queries costs less than scaling every [b, group, ctx] score
    # Plain bmm, then the mask: baddbmm first materialises the broadcast bias, and bmm into
    # a strided ``out=`` view is ~3x slower than into a fresh tensor (measured on CPU, torch 2.13).
    heads = []
    for h in range(kv_heads):
        q_h = q[:, h * group : (h + 1) * group]  # [b, group, d]
        scores = torch.bmm(q_h, k[:, :, h].transpose(1, 2)).masked_fill_(bucket.padding, float("-inf"))
        heads.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h]))  # [b, group, d]
    return torch.stack(heads, dim=1).view(batch, num_heads, head_dim).to(dtype)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,  # q: [batch, num_heads, head_dim]
    stride_kb,
    stride_ks,
    stride_kh,  # caches: [num_blocks, block_size, kv_heads, head_dim]
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt_b,
    stride_bt_i,  # block_tables: [batch, max_blocks]
    stride_ot,
    stride_oh,  # out: [batch, num_heads, head_dim]
    split_len,  # tokens per split, a multiple of BLOCK_N
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
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
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = split * split_len
    end = tl.minimum(ctx, start + split_len)

    g = tl.arange(0, GROUP_PAD)  # query head within the group (padded: tl.dot needs >= 16 rows)
    d = tl.arange(0, DIM_PAD)
    head = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )  # [GROUP_PAD, DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite so fully masked rows never give NaN
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # token positions of this tile
        t_ok = t < end
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
        m_i, l_i, acc = online_softmax_step(q, k, v, t_ok[None, :], m_i, l_i, acc, scale_log2, UPCAST)

    row_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + b * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        # partials: out [batch, num_heads, NUM_SPLITS, DIM_PAD], (m, l) [batch, num_heads, NUM_SPLITS, 2]
        row = (b * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * DIM_PAD + d[None, :], acc, mask=row_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _reduce_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s  # [SPLITS_PAD]
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=-1.0e30)
    lse = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)  # each split's softmax sum
    acc = tl.load(part_out_ptr + row[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # empty splits have m = -1e30 and weigh 0
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(lse * weight, axis=0)  # [DIM_PAD]
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(batch: int, kv_heads: int, max_ctx: int, device: torch.device) -> int:
    """Enough (request, kv head, split) programs to fill the device, never a split under _MIN_SPLIT_TOKENS."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(target, batch * kv_heads)
    return max(1, min(wanted, max_ctx // _MIN_SPLIT_TOKENS, 64))


def paged_decode_triton(
    q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None, block_n=_BLOCK_N, out=None
):
    """``num_splits``/``block_n`` override the tuning (tests); ``out`` lets a test pass a poisoned buffer."""
    batch, num_heads, head_dim = q.shape
    num_blocks, page_size, kv_heads, _ = k_cache.shape
    assert num_heads % kv_heads == 0, (q.shape, k_cache.shape)
    upcast = q.dtype == torch.float32 or not q.is_cuda  # the CPU interpreter cannot dot bf16
    kv = kv_tile_format(q, k_cache, upcast)
    assert v_cache.shape == k_cache.shape and block_tables.shape[0] == batch == context_lens.shape[0]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_n >= 16 and block_n & (block_n - 1) == 0
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    group = num_heads // kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    # The upper bound on context from the table width avoids a device sync on context_lens.
    max_ctx = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_ctx, q.device)
    split_len = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
    part_out = part_ml = out  # unused when there is one split
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, dim_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_out,
        part_ml,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        out.stride(0),
        out.stride(1),
        split_len,
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        UPCAST=upcast,
        COMPUTE=kv.compute,
        KV_INT8=kv.kv_int8,
        GROUP_SIZE=kv.group_size,
    )
    if num_splits > 1:
        _reduce_kernel[(batch, num_heads)](
            part_out,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
        )
    return out
