"""cuda_ipc per transfer: a device window holding only the blocks of one reservation, for its assigned sender.

The decode worker's pool is never exported. For each transfer over cuda_ipc the receiver leases a buffer
from a small arena (kvtransfer/window_arena.py: recycled, because opening an IPC mapping is costly;
scrubbed before another transfer gets it), exports the buffer's own IPC handle (kvtransfer/cuda_ipc.py:
an allocation of its own, never a slice of torch's cache) and names it only in a ``WindowGrant`` to the
connection authenticated with the key the range was reserved for. The sender copies its blocks into the
window's slots; each ``BlockWrite`` is checked against the ownership table first, and only then are the
named slots copied into the pool, device to device:

    window (sender writes, slot i = reserved block i)          pool (only the receiver writes)
    [L, 2, n, bs, kvh, d]  ──copy, after the ownership check──▶  pool[:, :, reserved ids]

When the transfer ends the receiver stops copying (``drop``); the sender closes its mapping and says so
(``WindowRelease``, ``release``). Only then is the buffer scrubbed and leased again; one whose sender never
releases it is freed after the grace and never handed out again. Cost: two copies where the whole-pool
export had one (the sender's into the window, the receiver's into the pool), plus a memset on reuse.
Same calls as ``ShmWindows``, so the receiver handles both alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtransfer import cuda_ipc
from kvtransfer.block_runs import copy_blocks
from kvtransfer.pool import PoolLayout
from kvtransfer.shm_window import window_shape
from kvtransfer.window_arena import Buffer, WindowArena
from protocol.kv_messages import CudaIpcHandle, WindowGrant


class CudaWindows:
    """The receiver's live cuda_ipc windows: at most one per transfer attempt."""

    def __init__(self, layout: PoolLayout, arena: WindowArena, export: Callable[[Buffer], CudaIpcHandle]):
        self.layout = layout
        self.arena = arena
        self._export = export
        self._slot_of: dict[tuple[str, int], dict[int, int]] = {}  # open windows: reserved id -> slot

    def open(self, rid: str, generation: int, block_ids: tuple[int, ...], key: str) -> WindowGrant:
        """A window for reservation ``rid`` (an older attempt's is dropped), granted to ``key`` alone. Asked
        again for the same attempt, the same window: a peer cannot pile up allocations by asking twice."""
        if (rid, generation) not in self._slot_of:
            self.drop(rid)
            lease = self.arena.lease(rid, generation, key, len(block_ids) * self.layout.bytes_per_block)
            data = lease.buffer.bytes()
            if data.is_cuda:  # a recycled buffer's scrub lands before the sender's first write
                torch.cuda.current_stream(data.device).synchronize()
            self._slot_of[(rid, generation)] = {b: i for i, b in enumerate(block_ids)}
        lease = self.arena.get(rid, generation)
        return WindowGrant(rid, generation, "", list(block_ids), self._export(lease.buffer))

    def copy_in(self, rid: str, generation: int, dst_block_ids: list[int], pool: torch.Tensor) -> bool:
        """Copy the slots of ``dst_block_ids`` (already checked as this reservation's) into the pool.
        False when the transfer has no open window of that generation (nothing copied)."""
        slot_of = self._slot_of.get((rid, generation))
        lease = self.arena.get(rid, generation)
        if slot_of is None or lease is None:
            return False
        window = self.window(lease.buffer, len(slot_of))
        copy_blocks(window, [slot_of[b] for b in dst_block_ids], pool, dst_block_ids)
        return True

    def window(self, buffer: Buffer, num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` slots of ``buffer`` as ``[L, 2, n, bs, kvh, d]``."""
        return view_window(buffer.bytes(), self.layout, num_blocks)

    def drop(self, rid: str, generation: int | None = None) -> None:
        """The receiver copies nothing more for ``rid`` (only that attempt's, when given)."""
        for k in [k for k in self._slot_of if k[0] == rid and generation in (None, k[1])]:
            del self._slot_of[k]
        self.arena.done(rid, generation)

    def release(self, rid: str, generation: int, key: str) -> bool:
        """The sender unmapped the window (only the key it was granted to counts)."""
        return self.arena.release(rid, generation, key)

    def expire(self) -> list[str]:
        return self.arena.expire()

    def drop_all(self) -> None:
        self._slot_of.clear()
        self.arena.close()

    def __len__(self) -> int:
        return len(self._slot_of)


def view_window(data: torch.Tensor, layout: PoolLayout, num_blocks: int) -> torch.Tensor:
    """A flat uint8 buffer's first ``num_blocks`` slots as a window of ``layout``."""
    num_bytes = num_blocks * layout.bytes_per_block
    if data.numel() < num_bytes:
        raise ValueError(f"a window of {num_blocks} blocks needs {num_bytes} bytes; the buffer has {data.numel()}")
    return data[:num_bytes].view(layout.dtype).view(window_shape(layout, num_blocks))


def cuda_windows(layout: PoolLayout, device: int) -> CudaWindows:
    """Windows of allocations of their own on ``device`` (the receiver's pool's GPU)."""
    arena = WindowArena(lambda n: cuda_ipc.allocate(device, n), granularity=cuda_ipc.IPC_GRANULARITY)
    return CudaWindows(layout, arena, cuda_ipc.export)
