"""The ctypes calls of the paged attention kernels, one for every dtype of the pool: the float32 ones
(decode.c, prefill.c) and the int8 ones (decode_int8.c, kv_int8_ops.c) take the same arguments, in the
same order; only the element type behind the cache pointers and the prefill work area differ."""

from __future__ import annotations

import ctypes

import torch

_PTR, _SIZE = ctypes.c_void_p, ctypes.c_int64
# q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens
_PAGED = [_PTR, _SIZE, _PTR, _PTR, _PTR, _SIZE, _PTR]
_SHAPE = [_SIZE] * 5  # batch, num_heads, kv_heads, head_dim, block_size
# + out, scratch; + max_context (padded)
DECODE_ARGTYPES = [*_PAGED, _PTR, _PTR, *_SHAPE, _SIZE, ctypes.c_float, ctypes.c_int]
# + query_start_loc, out, work
PREFILL_ARGTYPES = [*_PAGED, _PTR, _PTR, _PTR, *_SHAPE, ctypes.c_float, ctypes.c_int]


def bind(fn, argtypes: list):
    """``fn`` with its argument types set and no result."""
    fn.argtypes = argtypes
    fn.restype = None
    return fn


def check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, cache_dtype: torch.dtype) -> None:
    """The layout every paged kernel reads. The C code trusts it: a wrong one would read the wrong
    memory, not raise."""
    assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == cache_dtype
    assert q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and q.shape[1] % k_cache.shape[2] == 0
    assert block_tables.dtype == context_lens.dtype == torch.int64
    assert block_tables.is_contiguous() and context_lens.is_contiguous()
    assert block_tables.shape[0] == context_lens.shape[0]


def paged_decode(fn, q, k_cache, v_cache, block_tables, context_lens, max_context: int, scale: float) -> torch.Tensor:
    """One query token per request (``q`` [batch, heads, head_dim]); ``max_context`` >= every context,
    <= the tables' reach. Returns [batch, heads, head_dim] float32."""
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert batch == context_lens.shape[0] and block_tables.shape[1] * block_size >= max_context
    ctx_pad = -(-max_context // 16) * 16  # decode.c's softmax rows are whole vectors
    out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
    scratch = torch.empty(batch * num_heads * ctx_pad, dtype=torch.float32)  # softmax rows
    fn(
        *_paged_pointers(q, k_cache, v_cache, block_tables, context_lens),
        out.data_ptr(),
        scratch.data_ptr(),
        batch,
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        ctx_pad,
        scale,
        torch.get_num_threads(),
    )
    return out


def paged_prefill(
    fn, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale: float, work: torch.Tensor
) -> torch.Tensor:
    """Causal attention of each request's chunk over its paged context; ``work``: the kernel's per-thread
    area for torch.get_num_threads() threads. Returns [num_tokens, heads, head_dim] float32."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    assert query_start_loc.dtype == torch.int64 and query_start_loc.is_contiguous()
    assert query_start_loc.shape[0] == batch + 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    fn(
        *_paged_pointers(q, k_cache, v_cache, block_tables, context_lens),
        query_start_loc.data_ptr(),
        out.data_ptr(),
        work.data_ptr(),
        batch,
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    return out


def _paged_pointers(q, k_cache, v_cache, block_tables, context_lens) -> tuple:
    return (
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
    )
