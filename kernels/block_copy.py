"""Pack a request's blocks (all layers, K and V) into one contiguous buffer and back, for transports.

pool: [layers, 2, num_blocks, block_size, kv_heads, head_dim]; buffer: [layers, 2, n, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import torch


def gather_blocks_reference(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return pool.index_select(2, block_ids)


def scatter_blocks_reference(pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    pool.index_copy_(2, block_ids, buffer.to(pool.dtype))
