"""Store this step's new K/V rows into one layer of the paged pool through a slot mapping.

slot = block_id * block_size + offset_in_block, one per new token. The Triton kernels write one token's
``[kv_heads, head_dim]`` row of K and of V per program; the torch reference is one ``index_copy_``.
What is written depends on the pool's dtype (``--kv-cache-dtype``):

- a float pool: the rows cast to it;
- ``float8_e4m3fn`` (``fp8``): clamped to e4m3's finite range (+-448), then cast, with vLLM's default
  scale of 1.0; vLLM's CUDA store converts with ``__NV_SATFINITE``, which saturates the same way, where
  a plain cast would give NaN (e4m3fn has no infinity);
- ``int8``: each token's head quantized to a packed row with its float16 scales (kv_int8.py), by
  ``kv_int8.quantize_groups`` in the kernel, bit for bit ``kv_int8.quantize_rows``.
"""

from __future__ import annotations

import torch

from kernels.triton import kv_int8
from kernels.triton.triton_or_stub import tl, triton

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, row] (row: head_dim, or int8's packed row)
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, row]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    kv_heads, row = k_cache.shape[-2:]
    if k_cache.dtype == torch.int8:  # packed int8 rows: quantize per token per head (kv_int8.py)
        key, value = kv_int8.quantize_rows(key), kv_int8.quantize_rows(value)
    elif k_cache.dtype == torch.float8_e4m3fn:  # saturated, then copied as bytes (no fp8 index_copy_ on CPU)
        key = key.float().clamp(-FP8_MAX, FP8_MAX).to(k_cache.dtype).view(torch.uint8)
        value = value.float().clamp(-FP8_MAX, FP8_MAX).to(v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
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
    FP8: tl.constexpr,
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
    if FP8:  # saturate as vLLM's __NV_SATFINITE store does (FP8_MAX)
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_int8_rows(src_ptr, cache_ptr, h, g, j, src_off, row_off, mask, HEAD_DIM: tl.constexpr, GS: tl.constexpr):
    """One token's heads of K or V: [HEADS_PAD, GROUPS_PAD, GS_PAD] values in, packed rows out."""
    x = tl.load(src_ptr + src_off + g * GS + j, mask=mask, other=0.0).to(tl.float32)
    values, scale = kv_int8.quantize_groups(x)
    row = cache_ptr + row_off  # [HEADS_PAD, 1, 1] int8 pointers to each head's row
    tl.store(row + g * GS + j, values, mask=mask)
    scale_ptr = (row + HEAD_DIM + 2 * g).to(tl.pointer_type(tl.float16))  # [HEADS_PAD, GROUPS_PAD, 1]
    tl.store(scale_ptr, scale[:, :, None], mask=tl.max(mask.to(tl.int32), axis=2, keep_dims=True) > 0)


@triton.jit
def _store_kv_int8_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,  # caches: [num_blocks, block_size, kv_heads, row_dim] int8
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GS: tl.constexpr,  # values per scale (kv_int8.group_size)
    HEADS_PAD: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    GS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None, None]
    g = tl.arange(0, GROUPS_PAD)[None, :, None]
    j = tl.arange(0, GS_PAD)[None, None, :]
    mask = (h < KV_HEADS) & (g < HEAD_DIM // GS) & (j < GS)
    row_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch
    _store_int8_rows(key_ptr, k_cache_ptr, h, g, j, token * stride_kt + h * stride_kh, row_off, mask, HEAD_DIM, GS)
    _store_int8_rows(value_ptr, v_cache_ptr, h, g, j, token * stride_vt + h * stride_vh, row_off, mask, HEAD_DIM, GS)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    is_int8 = k_cache.dtype == torch.int8
    row = kv_int8.row_dim(head_dim) if is_int8 else head_dim
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,), (key.shape, value.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    assert k_cache.shape[2:] == (kv_heads, row), (k_cache.shape, key.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    args = (key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1))
    args += (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    heads_pad = triton.next_power_of_2(kv_heads)
    if is_int8:
        gs = kv_int8.group_size(head_dim)
        _store_kv_int8_kernel[(num_tokens,)](
            *args,
            BLOCK_SIZE=k_cache.shape[1],
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            GS=gs,
            HEADS_PAD=heads_pad,
            GROUPS_PAD=triton.next_power_of_2(head_dim // gs),
            GS_PAD=triton.next_power_of_2(gs),
            enable_fp_fusion=False,  # kv_int8.quantize_groups: ties decided on the rounded product
        )
        return
    _store_kv_kernel[(num_tokens,)](
        *args,
        BLOCK_SIZE=k_cache.shape[1],
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
