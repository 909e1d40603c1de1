"""The bindings of the int8-KV kernels (``--kv-cache-dtype int8``): decode attention (decode_int8.c),
prefill attention (prefill.c) and the RoPE + quantizing K/V store (kv_int8_ops.c), over pools of packed int8 rows
``[head_dim values | float16 scales]`` (kernels/triton/kv_int8.py). Same arguments as the float32
kernels' (kernels/cpu/paged_call.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu import paged_call
from kernels.cpu.native import NativeLibrary
from kernels.triton import kv_int8

_PTR, _SIZE = ctypes.c_void_p, ctypes.c_int64


class Int8KV:
    """``decode``, ``prefill`` and ``rope_store`` as NativeLibrary's paged_decode, paged_prefill and
    rope_store, for int8 caches ``[num_blocks, block_size, kv_heads, kv_int8.row_dim(head_dim)]``."""

    def __init__(self, library: NativeLibrary):
        self.library = library
        self._decode = paged_call.bind(library.symbol("pdserve_paged_decode_i8"), paged_call.DECODE_ARGTYPES)
        self._prefill = paged_call.bind(library.symbol("pdserve_paged_prefill_i8"), paged_call.PREFILL_ARGTYPES)
        self._rope_store = paged_call.bind(
            library.symbol("pdserve_rope_store_i8"), [_PTR, *[_SIZE] * 5, *[_PTR] * 5, ctypes.c_int]
        )

    def _check(self, q, k_cache, v_cache, block_tables, context_lens) -> None:
        paged_call.check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, torch.int8)
        head_dim = q.shape[2]
        assert k_cache.shape[3] == kv_int8.row_dim(head_dim)
        assert self.library.supports(q.shape[1] // k_cache.shape[2], head_dim)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, max_context: int, scale: float) -> torch.Tensor:
        self._check(q, k_cache, v_cache, block_tables, context_lens)
        return paged_call.paged_decode(
            self._decode, q, k_cache, v_cache, block_tables, context_lens, max_context, scale
        )

    def prefill(self, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale: float) -> torch.Tensor:
        self._check(q, k_cache, v_cache, block_tables, context_lens)
        work = self.library.prefill_scratch(torch.get_num_threads())  # prefill.c's per-thread tiles
        return paged_call.paged_prefill(
            self._prefill, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, work
        )

    def rope_store(self, qkv, num_heads: int, kv_heads: int, cos, sin, slots, k_cache, v_cache) -> None:
        """NativeLibrary.rope_store into int8 caches ``[..., kv_heads, row]``: K and V quantized as
        kv_int8.quantize_rows does, to the bit. Every slot below the caches' slots (the caller checks)."""
        tokens = qkv.shape[0]
        head_dim = kv_int8.head_dim_of(k_cache.shape[-1])
        assert qkv.dtype == cos.dtype == sin.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.int8
        assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (num_heads + 2 * kv_heads) * head_dim
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == tokens * (head_dim // 2)
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (tokens,)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        assert k_cache.shape[-2] == kv_heads and head_dim % 2 == 0
        self._rope_store(
            qkv.data_ptr(),
            qkv.stride(0),
            tokens,
            num_heads,
            kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            torch.get_num_threads(),
        )


@functools.cache
def int8_kernels(library: NativeLibrary) -> Int8KV:
    """The library's int8 bindings, made once."""
    return Int8KV(library)
