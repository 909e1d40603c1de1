"""Store this step's new K/V rows into one layer of the paged pool through a slot mapping.

slot = block_id * block_size + offset_in_block, one per new token. The Triton kernel copies one token's
``[kv_heads, head_dim]`` row of K and of V per program; the torch reference is one ``index_copy_``.
"""

from __future__ import annotations

import torch

from kernels.triton import kv_int8
from kernels.triton.triton_or_stub import tl, triton


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    kv_heads, row = k_cache.shape[-2:]
    if k_cache.dtype == torch.int8:  # packed int8 rows: quantize per token per head (kv_int8.py)
        key, value = kv_int8.quantize_rows(key), kv_int8.quantize_rows(value)
    k_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,  # key: [num_tokens, kv_heads, head_dim], last dim contiguous
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,  # caches: [num_blocks, block_size, kv_heads, head_dim]
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    cache_off = block * stride_cb + offset * stride_cs + h * stride_ch + d  # [HEADS_PAD, DIM_PAD]
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,), (key.shape, value.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (kv_heads, head_dim), (k_cache.shape, key.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
