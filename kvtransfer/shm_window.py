"""shm per transfer: a window holding only the blocks of one reservation, for its assigned sender alone.

The decode worker's pool is never handed to a peer. For each transfer over shm the receiver makes a
/dev/shm segment of exactly the reservation's blocks (slot i holds reserved block i) and names it only in
a ``WindowGrant`` to the connection authenticated with the key the range was reserved for. The sender
copies its blocks into the window's slots; each ``BlockWrite`` is checked against the ownership table
first, and only then are the named slots copied into the pool. A peer can therefore write nothing outside
its reserved blocks: the only memory it maps is its own window.

    window (sender writes)          pool (only the receiver writes)
    [L, 2, n, bs, kvh, d]   ──copy, after the ownership check──▶   pool[:, :, reserved ids]

The segment is unlinked at the first write (the sender has mapped it by then: nobody else can open it
afterwards) and dropped when the transfer ends. Cost: one more copy than mapping the whole pool (the
sender's copy into the window, then the receiver's into the pool), the zmq path's count: a window of
*only* the reserved blocks cannot alias the pool itself, whose blocks are strided across layers
(``[L, 2, num_blocks, ...]``) and not page-aligned, so no mapping of a subset of them exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvtransfer.block_runs import copy_blocks
from kvtransfer.pool import PoolLayout
from kvtransfer.shm_pool import SharedTensor, attach_shared, create_shared
from protocol.kv_messages import WindowGrant


@dataclass(slots=True)
class Window:
    generation: int
    shared: SharedTensor  # [L, 2, n, bs, kvh, d], the receiver's mapping
    slot_of: dict[int, int]  # reserved block id -> its slot in the window
    unlinked: bool = False


def window_shape(layout: PoolLayout, num_blocks: int) -> tuple[int, ...]:
    shape = layout.shape
    return (shape[0], shape[1], num_blocks, *shape[3:])


class ShmWindows:
    """The receiver's live windows, one per reservation at most."""

    def __init__(self, layout: PoolLayout):
        self.layout = layout
        self._windows: dict[str, Window] = {}

    def open(self, rid: str, generation: int, block_ids: tuple[int, ...], key: str) -> WindowGrant:
        """A new window for reservation ``rid`` (replacing any older one), for ``key`` (the caller sends
        the grant to it alone): its segment name."""
        self.drop(rid)
        shared = create_shared(window_shape(self.layout, len(block_ids)), self.layout.dtype, f"win-{os.getpid()}")
        self._windows[rid] = Window(generation, shared, {b: i for i, b in enumerate(block_ids)})
        return WindowGrant(rid, generation, shared.name, list(block_ids))

    def copy_in(self, rid: str, generation: int, dst_block_ids: list[int], pool: torch.Tensor) -> bool:
        """Copy the slots of ``dst_block_ids`` (already checked as this reservation's) into the pool.
        False when the transfer has no window of that generation (nothing copied)."""
        window = self._windows.get(rid)
        if window is None or window.generation != generation:
            return False
        if not window.unlinked:  # the sender mapped it before it wrote: nobody can open it any more
            window.shared.unlink()
            window.unlinked = True
        slots = [window.slot_of[b] for b in dst_block_ids]
        copy_blocks(window.shared.tensor, slots, pool, dst_block_ids)
        return True

    def drop(self, rid: str, generation: int | None = None) -> None:
        """Forget ``rid``'s window (only of that generation, when given: an old failure keeps a retry's)."""
        window = self._windows.get(rid)
        if window is None or (generation is not None and window.generation != generation):
            return
        del self._windows[rid]
        if not window.unlinked:
            window.shared.unlink()

    def release(self, rid: str, generation: int, key: str) -> bool:
        """Nothing to release: the segment was unlinked at the first write and is never reused."""
        return False

    def expire(self) -> list[str]:
        return []

    def drop_all(self) -> None:
        for rid in list(self._windows):
            self.drop(rid)

    def __len__(self) -> int:
        return len(self._windows)


def attach_window(name: str, layout: PoolLayout, num_blocks: int) -> torch.Tensor:
    """Sender side: map a granted window (its size must be exactly ``num_blocks`` of ``layout``)."""
    return attach_shared(name, window_shape(layout, num_blocks), layout.dtype).tensor
