"""The node's one preallocated KV pool: ``[layers, 2, num_blocks, block_size, kv_heads, row_dim]``.

``row_dim`` is ``head_dim`` for a float pool; an int8 pool (``--kv-cache-dtype int8``) packs each row's
float16 scales (one per 16 values) after its values (kernels/triton/kv_int8.py), so a block carries its scales with it.

Attention reads it through block tables; transports move whole blocks of it (all layers at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton import kv_int8


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_dim(self) -> int:
        """Elements of one token's one head in the pool: int8 rows carry their scale (4 bytes) too."""
        return kv_int8.row_dim(self.head_dim) if self.dtype == torch.int8 else self.head_dim

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.row_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (scales included)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.row_dim * element


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks that fit in a memory budget; at least one block must fit."""
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is smaller than one block ({bytes_per_block} bytes)")
    return num_blocks


class KVPool:
    """Owns the pool tensor. ``tensor`` may be given (e.g. one that lives in shared memory), or replaced
    later by an identical one (the decode node moves its pool into shared memory after building it)."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu", tensor: torch.Tensor | None = None):
        self.layout = layout
        self.tensor = tensor if tensor is not None else torch.zeros(layout.shape, dtype=layout.dtype, device=device)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @tensor.setter
    def tensor(self, tensor: torch.Tensor) -> None:
        layout = self.layout
        assert tuple(tensor.shape) == layout.shape and tensor.dtype == layout.dtype, (tensor.shape, layout)
        assert tensor.is_contiguous()
        self._tensor = tensor
        # Every layer's K and V views, made once: indexing them out of the pool on every layer of every
        # step was 4 torch ops per layer.
        self._layers = [(tensor[i, 0], tensor[i, 1]) for i in range(layout.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each ``[num_blocks, block_size, kv_heads, row_dim]``."""
        return self._layers[index]
