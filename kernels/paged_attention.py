"""Attention of a varlen batch of query chunks over each request's paged KV.

Request i owns queries ``q[query_start_loc[i] : query_start_loc[i+1]]``: the *last* q_len_i tokens of
its context of ``context_lens[i]`` tokens, whose K/V are already stored in the pool. Query j of the
chunk sits at position ``context_lens[i] - q_len_i + j`` and attends causally to keys ``0 ..= pos``.
Decode is the case q_len_i == 1; chunked prefill attends to the cached prefix plus its own chunk.

Every request in a batch has at least one query token (the runner schedules no empty rows).
"""

from __future__ import annotations

import torch

from kernels.paged_decode import paged_decode_reference, paged_decode_triton
from kernels.paged_prefill import paged_prefill_reference, paged_prefill_triton


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32/int64
    context_lens: torch.Tensor,  # [batch] int, tokens of context including this step's
    query_start_loc: torch.Tensor,  # [batch + 1] int, cumulative query lengths
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The engine's CPU path: decode rows by batched matmul, prefill rows by padded SDPA."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [batch]
    is_decode = q_lens == 1
    if bool(is_decode.all()):
        return paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    if not bool(is_decode.any()):
        return paged_prefill_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # Decode rows: their single query token is query_start_loc[i].
    dec_tokens = query_start_loc[:-1][is_decode].long()  # [num_decode]
    out.index_copy_(0, dec_tokens, paged_decode_reference(
        q.index_select(0, dec_tokens), k_cache, v_cache, block_tables[is_decode], context_lens[is_decode], scale))
    # Prefill rows: repack their chunks densely, run them, and put them back in query order.
    pre = ~is_decode
    pre_lens = q_lens[pre]
    pre_loc = torch.zeros(pre_lens.shape[0] + 1, dtype=query_start_loc.dtype, device=q.device)
    torch.cumsum(pre_lens, 0, out=pre_loc[1:])
    token_is_pre = torch.repeat_interleave(pre, q_lens, output_size=q.shape[0])  # [num_tokens]
    pre_tokens = token_is_pre.nonzero()[:, 0]
    out.index_copy_(0, pre_tokens, paged_prefill_reference(
        q.index_select(0, pre_tokens), k_cache, v_cache, block_tables[pre], context_lens[pre], pre_loc, scale))
    return out


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """Decode kernel when every q_len is 1 (one token per request), else the chunked-prefill kernel."""
    if q.shape[0] == block_tables.shape[0]:  # with every q_len >= 1 this means every q_len == 1
        return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_prefill_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
