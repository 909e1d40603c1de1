"""The cuda_ipc window bookkeeping on CPU (kvtransfer/window_arena.py, cuda_window.py): the same code the GPU
runs, with CPU tensors for buffers and a stand-in for the IPC export. A window goes to another transfer
only once the receiver is done with it and its peer released it, and then zeroed; one its peer never
released is freed after the grace and never handed out again; nothing leaks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.kv.pool import KVLayout
from kvtransfer.cuda_window import CudaWindows, view_window
from kvtransfer.window_arena import WindowArena
from protocol.codec import decode, encode
from protocol.kv_messages import CudaIpcHandle, WindowGrant, WindowRelease

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK = LAYOUT.bytes_per_block  # 1024 bytes
GRANULE = 4 * BLOCK


@dataclass(slots=True)
class CpuBuffer:
    num_bytes: int
    data: torch.Tensor | None

    def bytes(self) -> torch.Tensor:
        assert self.data is not None, "used after free"
        return self.data

    def free(self) -> None:
        assert self.data is not None, "freed twice"
        self.data = None


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_arena(clock: Clock, max_idle_bytes: int = 1 << 20) -> tuple[WindowArena, list[CpuBuffer]]:
    made: list[CpuBuffer] = []

    def allocate(num_bytes: int) -> CpuBuffer:
        made.append(CpuBuffer(num_bytes, torch.zeros(num_bytes, dtype=torch.uint8)))
        return made[-1]

    arena = WindowArena(allocate, granularity=GRANULE, release_grace_s=30.0, max_idle_bytes=max_idle_bytes, clock=clock)
    return arena, made


def assert_no_leak(arena: WindowArena, made: list[CpuBuffer]) -> None:
    arena.close()
    assert arena.num_leased == 0 and arena.idle_bytes == 0
    assert all(b.data is None for b in made), "a buffer outlived the arena"


def test_lease_rounds_up_and_reuses_only_after_done_and_release_scrubbed():
    arena, made = make_arena(Clock())
    a = arena.lease("r1", 1, "key-a", 3 * BLOCK)
    assert a.buffer.num_bytes == GRANULE and len(made) == 1
    a.buffer.bytes().fill_(7)  # peer A's blocks
    arena.done("r1", 1)
    b = arena.lease("r2", 1, "key-b", BLOCK)  # done but not released: A may still map it
    assert b.buffer is not a.buffer and len(made) == 2
    assert arena.release("r1", 1, "key-a")
    c = arena.lease("r3", 1, "key-c", 2 * BLOCK)
    assert c.buffer is a.buffer and len(made) == 2
    assert int(c.buffer.bytes().count_nonzero()) == 0, "A's bytes reached C"
    assert_no_leak(arena, made)


def test_released_before_done_waits_for_the_receiver():
    arena, made = make_arena(Clock())
    a = arena.lease("r1", 1, "key-a", BLOCK)
    assert arena.release("r1", 1, "key-a")  # the sender failed early; the receiver may still copy out
    assert arena.lease("r2", 1, "key-b", BLOCK).buffer is not a.buffer
    arena.done("r1", 1)
    assert arena.lease("r3", 1, "key-b", BLOCK).buffer is a.buffer
    assert_no_leak(arena, made)


def test_only_the_granted_key_releases_once():
    arena, made = make_arena(Clock())
    a = arena.lease("r1", 1, "key-a", BLOCK)
    arena.done("r1", 1)
    assert not arena.release("r1", 1, "key-b")  # another key cannot hand A's mapping on
    assert not arena.release("r1", 2, "key-a")  # nor can a release of another attempt
    assert arena.lease("r2", 1, "key-b", BLOCK).buffer is not a.buffer
    assert arena.release("r1", 1, "key-a") and not arena.release("r1", 1, "key-a")
    assert_no_leak(arena, made)


def test_never_released_is_freed_after_the_grace_and_never_reused():
    clock = Clock()
    arena, made = make_arena(clock)
    a = arena.lease("r1", 1, "key-a", BLOCK)
    clock.now += 1000.0  # a live transfer is the ownership lease's business, not the arena's
    assert arena.expire() == []
    arena.done("r1", 1)
    clock.now += 29.9
    assert arena.expire() == []
    clock.now += 0.1
    assert arena.expire() == ["r1"] and arena.num_retired == 1
    assert a.buffer.data is None  # freed
    assert not arena.release("r1", 1, "key-a")  # too late: nothing to release
    assert arena.lease("r2", 1, "key-b", BLOCK).buffer is not a.buffer and len(made) == 2
    assert_no_leak(arena, made)


def test_attempts_of_one_rid_are_separate_leases():
    arena, made = make_arena(Clock())
    first = arena.lease("r1", 1, "key-a", BLOCK)
    arena.done("r1", 1)
    retry = arena.lease("r1", 2, "key-a", BLOCK)  # the first attempt's mapping may still be open
    assert retry.buffer is not first.buffer
    arena.done("r1", 1)  # a late failure of attempt 1 leaves attempt 2 alone
    assert arena.get("r1", 2).done_at is None
    arena.done("r1")  # the request aborted: every attempt
    assert arena.get("r1", 2).done_at is not None
    assert_no_leak(arena, made)


def test_idle_buffers_are_capped_largest_freed_first():
    arena, made = make_arena(Clock(), max_idle_bytes=3 * GRANULE)
    for i, blocks in enumerate((1, 9, 5)):  # 1, 3 and 2 granules
        arena.lease(f"r{i}", 1, "key-a", blocks * BLOCK)
        arena.done(f"r{i}", 1)
        arena.release(f"r{i}", 1, "key-a")
    assert arena.idle_bytes == 3 * GRANULE
    assert [b.num_bytes for b in made if b.data is None] == [3 * GRANULE]
    assert arena.lease("r9", 1, "key-b", 5 * BLOCK).buffer is made[2]  # the smallest that fits
    assert_no_leak(arena, made)


def fake_export(buffer: CpuBuffer) -> CudaIpcHandle:
    return CudaIpcHandle(0, bytes(64), buffer.num_bytes)


def test_cuda_windows_copy_only_the_checked_slots_into_the_pool():
    clock = Clock()
    arena, made = make_arena(clock)
    windows = CudaWindows(LAYOUT, arena, fake_export)
    pool = torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    grant = windows.open("r1", 1, (9, 3, 12), "key-a")
    assert (grant.name, grant.block_ids, grant.cuda_window.size_bytes) == ("", [9, 3, 12], GRANULE)
    assert windows.open("r1", 1, (9, 3, 12), "key-a") == grant  # asked twice: the same window, not a second
    assert (arena.num_leased, len(made)) == (1, 1)
    lease = arena.get("r1", 1)
    window = view_window(lease.buffer.bytes(), LAYOUT, 3)  # what the sender maps: [L, 2, 3, bs, kvh, d]
    sent = torch.randn(window.shape, generator=torch.Generator().manual_seed(2))
    window.copy_(sent)
    assert not windows.copy_in("r1", 2, [9], pool)  # another attempt's write: nothing copied
    assert windows.copy_in("r1", 1, [12, 9], pool)
    expected = before.clone()
    expected[:, :, [12, 9]] = sent[:, :, [2, 0]]
    assert torch.equal(pool, expected)  # block 3 (not yet written) and every other block untouched
    windows.drop("r1", 1)
    assert len(windows) == 0 and not windows.copy_in("r1", 1, [3], pool)
    assert windows.release("r1", 1, "key-a")
    assert windows.open("r2", 1, (0,), "key-b").cuda_window.size_bytes == GRANULE
    assert int(arena.get("r2", 1).buffer.bytes().count_nonzero()) == 0  # scrubbed before B saw it
    windows.drop_all()
    assert all(b.data is None for b in made)


def test_a_window_too_small_for_its_blocks_is_refused():
    with pytest.raises(ValueError, match="needs 3072 bytes; the buffer has 2048"):
        view_window(torch.zeros(2 * BLOCK, dtype=torch.uint8), LAYOUT, 3)


def test_window_records_round_trip():
    grant = WindowGrant("r1", 3, "", [4, 5], CudaIpcHandle(1, bytes(range(64)), 2 * 2**20))
    assert decode(encode(grant)) == grant
    assert decode(encode(WindowRelease("r1", 3, "inc"))) == WindowRelease("r1", 3, "inc")
