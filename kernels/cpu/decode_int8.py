"""The binding of the int8-KV decode attention kernel (decode_int8.c): float32 queries over a pool of
packed int8 rows ``[head_dim values | float32 scales]`` (kernels/triton/kv_int8.py)."""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu.native import NativeLibrary
from kernels.triton import kv_int8

_PTR, _SIZE = ctypes.c_void_p, ctypes.c_int64


class Int8Decode:
    """``run(q, k_cache, v_cache, tables, lens, max_context, scale)`` like NativeLibrary.paged_decode."""

    def __init__(self, library: NativeLibrary):
        self.library = library
        self._fn = library.symbol("pdserve_paged_decode_i8")
        self._fn.argtypes = [_PTR, _SIZE, _PTR, _PTR, _PTR, _SIZE, _PTR, _PTR, _PTR]
        self._fn.argtypes += [_SIZE] * 6 + [ctypes.c_float, ctypes.c_int]
        self._fn.restype = None

    def run(
        self,
        q: torch.Tensor,  # [batch, num_heads, head_dim] float32; rows may be strided, heads packed
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, kv_int8.row_dim(head_dim)] int8, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, max_blocks] int64, contiguous, ids checked by the caller
        context_lens: torch.Tensor,  # [batch] int64, each >= 1
        max_context: int,
        scale: float,
    ) -> torch.Tensor:  # [batch, num_heads, head_dim] float32
        batch, num_heads, head_dim = q.shape
        _, block_size, kv_heads, row = k_cache.shape
        # The C code trusts the layout: a wrong one would read the wrong memory, not raise.
        assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.int8
        assert row == kv_int8.row_dim(head_dim)
        assert q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k_cache.shape == v_cache.shape and num_heads % kv_heads == 0
        assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.is_contiguous()
        assert context_lens.is_contiguous() and batch == context_lens.shape[0] == block_tables.shape[0]
        assert block_tables.shape[1] * block_size >= max_context
        assert self.library.supports(num_heads // kv_heads, head_dim)
        out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
        scratch = torch.empty(batch * num_heads * max_context, dtype=torch.float32)  # softmax rows
        self._fn(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            batch,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            max_context,
            scale,
            torch.get_num_threads(),
        )
        return out
