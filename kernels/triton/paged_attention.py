"""Attention of a varlen batch of query chunks over each request's paged KV.

Request i owns queries ``q[query_start_loc[i] : query_start_loc[i+1]]``: the *last* q_len_i tokens of
its context of ``context_lens[i]`` tokens, whose K/V are already stored in the pool. Query j of the
chunk sits at position ``context_lens[i] - q_len_i + j`` and attends causally to keys ``0 ..= pos``.
Decode is the case q_len_i == 1; chunked prefill attends to the cached prefix plus its own chunk.

Every request in a batch has at least one query token (the runner schedules no empty rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.native import NativeLibrary
from kernels.triton.paged_decode import (
    DecodeBucket,
    NativeDecode,
    paged_decode_reference,
    paged_decode_triton,
    plan_decode,
)
from kernels.triton.paged_prefill import NativePrefill, paged_prefill_triton, plan_prefill, prefill_rows


@dataclass(slots=True)
class PrefillRows:
    """The prefill requests of a mixed step, repacked densely (what paged_prefill_reference takes)."""

    tokens: torch.Tensor  # [n] int64: their query tokens' indices in the step
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor


@dataclass(slots=True)
class AttentionPlan:
    """How the CPU path splits one step's batch. It depends on the step only: the runner makes it once
    and every layer reuses it, instead of each layer re-deriving it from the tensors."""

    decode: list[DecodeBucket] | NativeDecode | None  # how the decode requests run; None: none decodes
    decode_tokens: torch.Tensor | None  # [d] int64: each decode request's token; None: every one decodes
    prefill: PrefillRows | None  # set in mixed steps only
    native_prefill: NativePrefill | None = None  # the prefill chunks for the C kernel; None: SDPA


def plan_attention(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache: torch.Tensor,
    native: NativeLibrary | None = None,
    native_prefill: NativeLibrary | None = None,
) -> AttentionPlan:
    """``cache``: any one layer's K cache (the buckets depend on its block size and bytes per token).
    ``native``: the C decode kernel, for a model it supports (else decode rows take the torch path);
    ``native_prefill``: the C prefill kernel, likewise (else prefill rows take SDPA)."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [batch]
    is_decode = q_lens == 1
    num_decode = int(is_decode.sum())
    if num_decode == q_lens.shape[0]:
        return AttentionPlan(plan_decode(block_tables, context_lens, cache, native), None, None)
    if num_decode == 0:
        return AttentionPlan(
            None, None, None, plan_prefill(block_tables, context_lens, query_start_loc, cache, native_prefill)
        )
    decode = plan_decode(block_tables[is_decode], context_lens[is_decode], cache, native)
    dec_tokens = query_start_loc[:-1][is_decode].long()  # a decode request's one query token
    pre = ~is_decode
    pre_lens = q_lens[pre]
    pre_loc = torch.zeros(pre_lens.shape[0] + 1, dtype=query_start_loc.dtype, device=q_lens.device)
    torch.cumsum(pre_lens, 0, out=pre_loc[1:])
    token_is_pre = torch.repeat_interleave(pre, q_lens, output_size=int(query_start_loc[-1]))  # [num_tokens]
    prefill = PrefillRows(token_is_pre.nonzero()[:, 0], block_tables[pre], context_lens[pre], pre_loc)
    chunks = plan_prefill(prefill.block_tables, prefill.context_lens, pre_loc, cache, native_prefill)
    return AttentionPlan(decode, dec_tokens, prefill, chunks)


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32/int64
    context_lens: torch.Tensor,  # [batch] int, tokens of context including this step's
    query_start_loc: torch.Tensor,  # [batch + 1] int, cumulative query lengths
    scale: float,
    plan: AttentionPlan | None = None,  # plan_attention(...) of these tensors, made once per step
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The engine's CPU path: decode rows by the C kernel where the plan says so, else by batched
    matmul; prefill rows by the C kernel where the plan says so, else by SDPA per request."""
    if plan is None:
        plan = plan_attention(block_tables, context_lens, query_start_loc, k_cache)
    if plan.decode is None:
        return prefill_rows(
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, plan.native_prefill
        )
    if plan.decode_tokens is None:
        return _decode_rows(q, k_cache, v_cache, plan.decode, scale)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dec, pre = plan.decode_tokens, plan.prefill
    out.index_copy_(0, dec, _decode_rows(q.index_select(0, dec), k_cache, v_cache, plan.decode, scale))
    # Prefill rows: run densely repacked, put back in query order.
    out.index_copy_(
        0,
        pre.tokens,
        prefill_rows(
            q.index_select(0, pre.tokens),
            k_cache,
            v_cache,
            pre.block_tables,
            pre.context_lens,
            pre.query_start_loc,
            scale,
            plan.native_prefill,
        ),
    )
    return out


def _decode_rows(q, k_cache, v_cache, decode: list[DecodeBucket] | NativeDecode, scale: float) -> torch.Tensor:
    if isinstance(decode, NativeDecode):
        return decode.run(q, k_cache, v_cache, scale)
    return paged_decode_reference(q, k_cache, v_cache, None, None, scale, decode)


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """Decode kernel when every q_len is 1 (one token per request), else the chunked-prefill kernel."""
    if q.shape[0] == block_tables.shape[0]:  # with every q_len >= 1 this means every q_len == 1
        return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_prefill_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
