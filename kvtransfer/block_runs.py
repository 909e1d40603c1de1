"""Block copy between two pools for the direct transports (loopback, shm, cuda_ipc).

Allocators hand out runs of consecutive ids more often than not; a run whose source and destination
are both consecutive is one strided slice copy, with no staging buffer. Scattered ids fall back to
``gather_blocks`` + ``scatter_blocks`` (two copies through a packed buffer).
"""

from __future__ import annotations

import torch

from kernels import gather_blocks, scatter_blocks

MAX_RUNS_FRACTION = 0.25  # more runs than this share of blocks: per-run launches cost more than packing


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src start, dst start, length)] of maximal runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks(src_pool: torch.Tensor, src: list[int], dst_pool: torch.Tensor, dst: list[int]) -> None:
    """dst_pool[:, :, dst[i]] = src_pool[:, :, src[i]] for every i; pools [L, 2, num_blocks, bs, kvh, d]."""
    assert len(src) == len(dst)
    spans = runs(src, dst)
    if len(spans) <= max(1, MAX_RUNS_FRACTION * len(src)) and src_pool.device == dst_pool.device:
        for s, d, n in spans:
            dst_pool[:, :, d : d + n].copy_(src_pool[:, :, s : s + n])  # [L, 2, n, bs, kvh, d] strided
        return
    buffer = gather_blocks(src_pool, torch.tensor(src, device=src_pool.device))  # [L, 2, n, bs, kvh, d]
    scatter_blocks(dst_pool, torch.tensor(dst, device=dst_pool.device), buffer.to(dst_pool.device))
