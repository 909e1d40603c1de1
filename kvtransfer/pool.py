"""The KV pool as the transfer plane sees it: a tensor ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]`` and its layout. Declared here, not imported: the engine's ``KVPool`` (engine/kv/pool.py)
fits it, and kvtransfer stays below the engine (kernels and protocol only)."""

from __future__ import annotations

from typing import Protocol

import torch


class PoolLayout(Protocol):
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        ...


class BlockPool(Protocol):
    layout: PoolLayout
    tensor: torch.Tensor  # contiguous, ``layout.shape``, ``layout.dtype``
