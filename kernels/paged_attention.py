"""Attention of a varlen batch of query chunks over each request's paged KV.

Request i owns queries ``q[query_start_loc[i] : query_start_loc[i+1]]``: the *last* q_len_i tokens of
its context of ``context_lens[i]`` tokens, whose K/V are already stored in the pool. Query j of the
chunk sits at position ``context_lens[i] - q_len_i + j`` and attends causally to keys ``0 ..= pos``.
Decode is the case q_len_i == 1; chunked prefill attends to the cached prefix plus its own chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_ctx: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim] -> [batch, max_ctx, kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-max_ctx // block_size)
    gathered = cache[block_tables[:, :num_blocks]]  # [batch, num_blocks, block_size, kvh, d]
    return gathered.flatten(1, 2)[:, :max_ctx]


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32/int64
    context_lens: torch.Tensor,  # [batch] int, tokens of context including this step's
    query_start_loc: torch.Tensor,  # [batch + 1] int, cumulative query lengths
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens = q.shape[0]
    device = q.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [batch]
    max_q = int(q_lens.max())
    max_ctx = int(context_lens.max())
    k = _gather_kv(k_cache, block_tables, max_ctx)  # [batch, max_ctx, kvh, d]
    v = _gather_kv(v_cache, block_tables, max_ctx)

    # Pad queries to [batch, max_q]; padded rows reuse a valid index and are dropped at the end.
    offsets = torch.arange(max_q, device=device)
    token_idx = (query_start_loc[:-1, None] + offsets).clamp(max=num_tokens - 1)  # [batch, max_q]
    is_real = offsets[None, :] < q_lens[:, None]  # [batch, max_q]
    q_pos = context_lens[:, None] - q_lens[:, None] + offsets  # [batch, max_q]
    k_pos = torch.arange(max_ctx, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < context_lens[:, None, None])

    out = F.scaled_dot_product_attention(
        q[token_idx].transpose(1, 2),  # [batch, heads, max_q, d]
        k.transpose(1, 2),  # [batch, kvh, max_ctx, d]
        v.transpose(1, 2),
        attn_mask=mask[:, None],  # [batch, 1, max_q, max_ctx]
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[is_real]  # [num_tokens, heads, d], in query order
