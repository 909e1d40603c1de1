"""Named assertion helpers for block accounting; every scenario test ends with one of them."""

from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.sched.scheduler import Scheduler


def assert_integrity(bm: BlockManager) -> None:
    """free + cached + in use == total, no block owned twice, ref counts match the live tables."""
    bm.check_integrity()
    assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_in_use_blocks == bm.num_blocks


def assert_block_counts(bm: BlockManager, *, free: int, cached: int, in_use: int) -> None:
    assert_integrity(bm)
    got = (bm.num_free_blocks, bm.num_cached_blocks, bm.num_in_use_blocks)
    assert got == (free, cached, in_use), f"(free, cached, in_use) = {got}, expected {(free, cached, in_use)}"


def assert_no_leak(bm: BlockManager) -> None:
    """Integrity holds and no block is referenced: every block is free or (idle) cached."""
    assert_integrity(bm)
    assert bm.num_in_use_blocks == 0, f"{bm.num_in_use_blocks} blocks still in use: {_held(bm)}"
    assert all(r == 0 for r in bm.ref_counts)


def assert_scheduler_idle(scheduler: Scheduler) -> None:
    """Nothing running or waiting, and the scheduler's block manager leaks nothing."""
    assert not scheduler.has_unfinished()
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert_no_leak(scheduler.block_manager)


def _held(bm: BlockManager) -> list[int]:
    return [b for b, r in enumerate(bm.ref_counts) if r]
