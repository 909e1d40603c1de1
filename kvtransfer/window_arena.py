"""A small reusable arena of transfer windows: who holds which buffer, and when it may be handed on.

cuda_ipc gives each transfer a window of only its blocks (kvtransfer/cuda_window.py), like shm
(kvtransfer/shm_window.py). Unlike a /dev/shm file, which is made per transfer, a CUDA IPC mapping is
costly to open, so buffers are recycled; and unlike an unlinked file, a mapping cannot be revoked by the
exporter: the peer keeps it until it closes it. So a buffer goes to another transfer only once both sides
have let go, and it is scrubbed (zeroed) first:

    lease() ─▶ LEASED ─ done() (the receiver copies no more) ──┐
                 │                                             ├─▶ both: scrub ─▶ IDLE ─▶ lease() again
                 └─ release() (the peer says it unmapped) ─────┘
    done, never released by the peer within ``release_grace_s`` ─▶ RETIRED: freed, never handed out again
    (a peer that did not let go may still map it; a buffer it can see must hold no one else's blocks.
    CUDA calls freeing memory another process still maps undefined; a peer that holds a window 30 s past
    its transfer is broken or hostile, and freeing beats leaking the memory for the process's life)

Device-agnostic: the buffers come from an ``allocate`` callable (CUDA memory of its own allocation in
production, CPU tensors in tests). No I/O; the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_RELEASE_GRACE_S = 30.0  # the transfer lease's horizon (ownership.DEFAULT_LEASE_S)
DEFAULT_MAX_IDLE_BYTES = 256 * 2**20  # scrubbed buffers kept for reuse; more are freed


class WindowCapacityError(RuntimeError):
    """No memory for a window; the message names the bytes asked for."""


class Buffer(Protocol):
    num_bytes: int  # the whole allocation: what a peer that maps it can see

    def bytes(self) -> torch.Tensor:
        """The allocation as a flat uint8 tensor of ``num_bytes``."""
        ...

    def free(self) -> None: ...


@dataclass(slots=True)
class Lease:
    rid: str
    generation: int
    key: str  # the peer it was handed to (its CURVE public key; "" on an unauthenticated plane)
    buffer: Buffer
    done_at: float | None = None  # when the receiver stopped copying out of it
    released: bool = False  # the peer said it closed its mapping

    def __post_init__(self):
        assert self.buffer.num_bytes > 0


class WindowArena:
    def __init__(
        self,
        allocate: Callable[[int], Buffer],
        *,
        granularity: int = 1,
        release_grace_s: float = DEFAULT_RELEASE_GRACE_S,
        max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._allocate = allocate
        self.granularity = granularity  # allocations are multiples of it (CUDA IPC: 2 MiB, see cuda_ipc.py)
        self.release_grace_s = release_grace_s
        self.max_idle_bytes = max_idle_bytes
        self._clock = clock
        self._leases: dict[tuple[str, int], Lease] = {}  # (rid, generation) -> its lease
        self._idle: list[Buffer] = []  # scrubbed, nobody maps them
        self.num_retired = 0  # buffers freed because their peer never released them

    def lease(self, rid: str, generation: int, key: str, num_bytes: int) -> Lease:
        """A scrubbed buffer of at least ``num_bytes`` for one transfer attempt, handed to ``key`` only."""
        assert (rid, generation) not in self._leases, f"{rid} generation {generation} already holds a window"
        fits = [b for b in self._idle if b.num_bytes >= num_bytes]
        if fits:
            buffer = min(fits, key=lambda b: b.num_bytes)
            self._idle.remove(buffer)
        else:
            buffer = self._allocate(-(-num_bytes // self.granularity) * self.granularity)
        lease = self._leases[(rid, generation)] = Lease(rid, generation, key, buffer)
        return lease

    def get(self, rid: str, generation: int) -> Lease | None:
        return self._leases.get((rid, generation))

    def done(self, rid: str, generation: int | None = None) -> None:
        """The receiver copies nothing more out of ``rid``'s window (of that attempt, when given;
        of every attempt otherwise): committed, failed or aborted."""
        for lease in list(self._leases.values()):
            if lease.rid != rid or generation not in (None, lease.generation) or lease.done_at is not None:
                continue
            lease.done_at = self._clock()
            if lease.released:
                self._recycle(lease)

    def release(self, rid: str, generation: int, key: str) -> bool:
        """The peer closed its mapping. Only the peer it was leased to can say so; False otherwise."""
        lease = self.get(rid, generation)
        if lease is None or lease.key != key or lease.released:
            return False
        lease.released = True
        if lease.done_at is not None:
            self._recycle(lease)
        return True

    def expire(self) -> list[str]:
        """Retire the windows whose peer did not release them within the grace after the transfer ended."""
        now = self._clock()
        late = [
            lease
            for lease in self._leases.values()
            if lease.done_at is not None and now - lease.done_at >= self.release_grace_s
        ]
        for lease in late:
            del self._leases[(lease.rid, lease.generation)]
            lease.buffer.free()
            self.num_retired += 1
        return [lease.rid for lease in late]

    def close(self) -> None:
        """Free every buffer (the receiver is going away)."""
        for lease in self._leases.values():
            lease.buffer.free()
        self._leases.clear()
        self._trim(0)

    @property
    def num_leased(self) -> int:
        return len(self._leases)

    @property
    def idle_bytes(self) -> int:
        return sum(b.num_bytes for b in self._idle)

    def _recycle(self, lease: Lease) -> None:
        del self._leases[(lease.rid, lease.generation)]
        lease.buffer.bytes().zero_()  # the next peer must not read this one's blocks
        self._idle.append(lease.buffer)
        self._trim(self.max_idle_bytes)

    def _trim(self, max_bytes: int) -> None:
        """Free the largest idle buffers until at most ``max_bytes`` stay idle."""
        self._idle.sort(key=lambda b: b.num_bytes)
        while self._idle and self.idle_bytes > max_bytes:
            self._idle.pop().free()
