"""Pack a request's blocks (all layers, K and V) into one contiguous buffer and back, for transports.

pool: [layers, 2, num_blocks, block_size, kv_heads, head_dim]; buffer: [layers, 2, n, block_size, kv_heads, head_dim].
One block of one layer's K (or V) is a contiguous run of ``block_size * kv_heads * head_dim`` elements in
both tensors, so the Triton kernel is a plain strided copy of such runs: exact, no arithmetic.
"""

from __future__ import annotations

import torch

from kernels.triton.triton_or_stub import tl, triton

_CHUNK = 1024  # elements each program copies


def gather_blocks_reference(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return pool.index_select(2, block_ids)


def scatter_blocks_reference(pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    pool.index_copy_(2, block_ids, buffer.to(pool.dtype))


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    stride_src_plane,
    stride_src_block,  # plane = (layer, k/v) flattened; a block is contiguous
    stride_dst_plane,
    stride_dst_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
    GATHER: tl.constexpr,
):
    i = tl.program_id(0)  # index into block_ids (= block index in the buffer)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    pool_block = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:  # pool -> buffer
        src_block = pool_block
        dst_block = i.to(tl.int64)
    else:  # buffer -> pool
        src_block = i.to(tl.int64)
        dst_block = pool_block
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_ptr + plane * stride_src_plane + src_block * stride_src_block + offs, mask=mask)
    tl.store(dst_ptr + plane * stride_dst_plane + dst_block * stride_dst_block + offs, x, mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    assert src.dtype == dst.dtype and src.shape[:2] == dst.shape[:2] and src.shape[3:] == dst.shape[3:]
    num_ids = block_ids.shape[0]
    if num_ids == 0:
        return
    for t in (src, dst):
        # planes [layers, 2] must flatten to one stride; each block a contiguous run
        assert t[0, 0, 0].is_contiguous() and t.stride(0) == 2 * t.stride(1), t.stride()
    block_numel = src[0, 0, 0].numel()
    grid = (num_ids, src.shape[0] * 2, triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        src,
        dst,
        block_ids.to(device=src.device),
        src.stride(1),
        src.stride(2),
        dst.stride(1),
        dst.stride(2),
        BLOCK_NUMEL=block_numel,
        CHUNK=_CHUNK,
        GATHER=gather,
    )


def gather_blocks_triton(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (optional) is the destination buffer, e.g. a poisoned one in tests."""
    num_layers, _, _, *block_shape = pool.shape
    buffer = out
    if buffer is None:
        buffer = torch.empty((num_layers, 2, block_ids.shape[0], *block_shape), dtype=pool.dtype, device=pool.device)
    assert buffer.shape == (num_layers, 2, block_ids.shape[0], *block_shape), (buffer.shape, pool.shape)
    _launch(pool, buffer, block_ids, gather=True)
    return buffer


def scatter_blocks_triton(pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    assert buffer.shape[2] == block_ids.shape[0], (buffer.shape, block_ids.shape)
    buffer = buffer.to(device=pool.device, dtype=pool.dtype)
    _launch(buffer, pool, block_ids, gather=False)
