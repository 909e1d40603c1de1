"""Kernels over the paged KV pool. CUDA tensors go to Triton; CPU tensors to the torch reference.

The pool of one node is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; the attention
functions take one layer's K and V caches, ``pool[layer, 0]`` and ``pool[layer, 1]``.
"""

from kernels.block_copy import gather_blocks_reference, scatter_blocks_reference
from kernels.paged_attention import paged_attention_reference
from kernels.store_kv import store_kv_reference


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)


def gather_blocks(pool, block_ids):
    return gather_blocks_reference(pool, block_ids)


def scatter_blocks(pool, block_ids, buffer) -> None:
    scatter_blocks_reference(pool, block_ids, buffer)


__all__ = ["gather_blocks", "paged_attention", "scatter_blocks", "store_kv"]
