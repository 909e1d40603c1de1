"""Kernels over the paged KV pool. CUDA tensors go to Triton; CPU tensors to the torch reference.

The pool of one node is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; the attention
functions take one layer's K and V caches, ``pool[layer, 0]`` and ``pool[layer, 1]``. A pool holds the
model's float type, e4m3 (``--kv-cache-dtype fp8``, CUDA) or packed int8 rows of ``kv_int8.row_dim(head_dim)``
(``int8``): the Triton store and attention kernels read and write all three, the CPU path float and int8.

One file per kernel, each holding the @triton.jit kernel, its launcher and its torch reference:
store_kv.py, paged_decode.py, paged_prefill.py (with paged_attention.py choosing between them),
block_copy.py, and lora_batched.py (the batched LoRA product; engine/lora/stacked.py dispatches to it).

Tests run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``. Triton reads that variable
when ``@triton.jit`` decorates a kernel, i.e. when these modules are imported, so it must be in the
environment before the first ``import kernels`` (tests/conftest.py sets it when CUDA is absent).
"""

from kernels.triton.block_copy import (
    gather_blocks_reference,
    gather_blocks_triton,
    scatter_blocks_reference,
    scatter_blocks_triton,
)
from kernels.triton.paged_attention import (
    AttentionPlan,
    paged_attention_reference,
    paged_attention_triton,
    plan_attention,
)
from kernels.triton.store_kv import store_kv_reference, store_kv_triton


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if k_cache.is_cuda:
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping.to(k_cache.device))
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, plan=None):
    """``plan``: the CPU path's ``plan_attention`` of this step, made once for every layer (optional)."""
    if q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, plan)


def gather_blocks(pool, block_ids):
    if pool.is_cuda:
        return gather_blocks_triton(pool, block_ids)
    return gather_blocks_reference(pool, block_ids)


def scatter_blocks(pool, block_ids, buffer) -> None:
    if pool.is_cuda:
        scatter_blocks_triton(pool, block_ids, buffer)
    else:
        scatter_blocks_reference(pool, block_ids, buffer)


__all__ = ["AttentionPlan", "gather_blocks", "paged_attention", "plan_attention", "scatter_blocks", "store_kv"]
