"""Keeps a finished job's blocks alive until its transfer ends.

The scheduler frees a job's blocks in the same step that computes its last chunk (max_tokens = 1),
but the KV sender may still have pieces queued behind the receiver's credit window (zmq gathers
them when it ships; shm copies them then). So before ``postprocess`` the job's sequence is forked
into a *holder*: the block manager counts one more reference on every block (they show as in use),
and the holder is deallocated when the transfer succeeds, fails or is aborted. Full blocks are in
the prefix cache already, so afterwards they stay reusable; the tail block goes back to the free list.
"""

from __future__ import annotations

import itertools

from engine.kv.block_manager import BlockManager
from engine.sched.sequence import Sequence, SequenceStatus


class BlockPins:
    def __init__(self, block_manager: BlockManager, first_holder_id: int = 1 << 40):
        self.block_manager = block_manager
        # Holder ids never meet the scheduler's (job ids count up from 0; forks of n > 1 are negative).
        self._ids = itertools.count(first_holder_id)
        self._holders: dict[str, Sequence] = {}  # rid -> holder

    def pin(self, rid: str, seq: Sequence) -> None:
        """Reference every block of ``seq`` (before the scheduler releases them)."""
        assert rid not in self._holders, f"{rid} pinned twice"
        holder = Sequence(next(self._ids), list(seq.token_ids), seq.params, status=SequenceStatus.RUNNING)
        self.block_manager.fork(seq, holder)
        self._holders[rid] = holder

    def unpin(self, rid: str) -> None:
        """Idempotent."""
        holder = self._holders.pop(rid, None)
        if holder is not None:
            self.block_manager.deallocate(holder)

    def is_pinned(self, rid: str) -> bool:
        return rid in self._holders

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(h.block_table) for h in self._holders.values())
