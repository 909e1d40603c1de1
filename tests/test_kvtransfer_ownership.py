"""kvtransfer.ownership: the receiver's state machine, by example and by random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtransfer.ownership import OwnershipError, OwnershipTable, RangeState, Verdict

NUM_BLOCKS = 12


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FreeList:
    """Stand-in for the engine's block manager: the free blocks, and who got them back."""

    def __init__(self, n=NUM_BLOCKS):
        self.free = list(range(n))

    def take(self, n):
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, block_ids):
        assert not set(block_ids) & set(self.free), f"double free of {block_ids}"
        self.free += block_ids


def _table(lease_s=30.0):
    clock, blocks = Clock(), FreeList()
    table = OwnershipTable(blocks.release, clock=clock, lease_s=lease_s)
    table.register_peer("P1")
    return table, clock, blocks


def test_happy_path_states_and_adopt():
    table, clock, blocks = _table()
    ids = blocks.take(3)
    r = table.reserve("a", 1, ids)
    assert r.state == RangeState.RESERVED and table.held_blocks() == {0: "a", 1: "a", 2: "a"}
    assert table.write("a", 1, "P1", [0, 1]) is Verdict.OK and r.state == RangeState.WRITING
    assert table.commit("a", 1, "P1") is Verdict.INCOMPLETE  # block 2 missing
    assert table.write("a", 1, "P1", [2]) is Verdict.OK
    assert table.commit("a", 1, "P1") is Verdict.OK and r.state == RangeState.COMMITTED
    assert table.write("a", 1, "P1", [2]) is Verdict.WRONG_STATE
    assert table.adopt("a") == (0, 1, 2) and r.state == RangeState.RELEASED
    assert table.held_blocks() == {} and blocks.free == list(range(3, NUM_BLOCKS))  # adopted, not released


def test_lease_renewed_by_progress_then_expires_and_frees():
    table, clock, blocks = _table(lease_s=5.0)
    table.reserve("a", 1, blocks.take(2))
    clock.now += 4.0
    assert table.write("a", 1, "P1", [0]) is Verdict.OK  # renews to now + 5
    clock.now += 4.0
    assert table.expire() == []
    clock.now += 1.0
    [r] = table.expire()
    assert r.rid == "a" and r.state == RangeState.EXPIRED and table.num_expired == 1
    assert sorted(blocks.free) == list(range(NUM_BLOCKS))
    assert table.write("a", 1, "P1", [1]) is Verdict.STALE


def test_stale_generation_unknown_incarnation_and_foreign_blocks_rejected_and_counted():
    table, clock, blocks = _table()
    table.reserve("a", 2, [0, 1])
    table.reserve("b", 1, [2])
    assert table.write("a", 1, "P1", [0]) is Verdict.STALE
    assert table.write("a", 2, "P9", [0]) is Verdict.UNKNOWN_INCARNATION
    assert table.write("a", 2, "P1", [2]) is Verdict.OUT_OF_RANGE  # b's block
    assert table.write("a", 2, "P1", [0]) is Verdict.OK  # binds a to P1
    table.register_peer("P2")
    assert table.write("a", 2, "P2", [1]) is Verdict.UNKNOWN_INCARNATION  # not a's owner
    assert table.num_rejected == {Verdict.STALE: 1, Verdict.UNKNOWN_INCARNATION: 2, Verdict.OUT_OF_RANGE: 1}


def test_abort_is_idempotent_and_generation_checked():
    table, clock, blocks = _table()
    table.reserve("a", 2, blocks.take(2))
    assert table.abort("a", generation=1) is False  # an old attempt's abort never kills the retry
    assert table.abort("a", generation=2) is True
    assert table.abort("a", generation=2) is False and table.abort("a") is False
    assert sorted(blocks.free) == list(range(NUM_BLOCKS))
    assert table.get("a").state == RangeState.ABORTED


def test_peer_restart_aborts_its_ranges_and_refuses_old_incarnation():
    table, clock, blocks = _table()
    table.reserve("a", 1, blocks.take(2))
    table.reserve("b", 1, blocks.take(1))
    table.write("a", 1, "P1", [0])
    aborted = table.forget_peer("P1")
    assert [r.rid for r in aborted] == ["a"] and table.held_blocks() == {2: "b"}
    assert table.write("b", 1, "P1", [2]) is Verdict.UNKNOWN_INCARNATION


def test_double_reservation_is_a_caller_bug():
    table, clock, blocks = _table()
    table.reserve("a", 1, [0, 1])
    with pytest.raises(OwnershipError, match=r"blocks \[1\] are already held by 'a'"):
        table.reserve("b", 1, [1, 2])
    with pytest.raises(OwnershipError, match="already holds a live range"):
        table.reserve("a", 2, [5])


class OwnershipMachine(RuleBasedStateMachine):
    """Random interleavings of reserve, write, commit, abort, adopt, expiry and peer restarts."""

    def __init__(self):
        super().__init__()
        self.clock, self.blocks = Clock(), FreeList()
        self.table = OwnershipTable(self.blocks.release, clock=self.clock, lease_s=10.0)
        self.peers = ["P0"]
        self.table.register_peer("P0")
        self.adopted: set[int] = set()  # blocks handed to requests on this node
        self.generation: dict[str, int] = {}
        # Last accepted write per block: (rid, generation); a block's data belongs to its holder.
        self.writer: dict[int, tuple[str, int]] = {}

    rids = st.sampled_from(["a", "b", "c", "d"])

    @rule(rid=rids, n=st.integers(1, 4))
    def reserve(self, rid, n):
        if rid in {r.rid for r in self.table.live()} or len(self.blocks.free) < n:
            return
        self.generation[rid] = self.generation.get(rid, 0) + 1
        self.table.reserve(rid, self.generation[rid], self.blocks.take(n))

    @rule(rid=rids, peer=st.integers(0, 3), stale=st.booleans(), data=st.data())
    def write(self, rid, peer, stale, data):
        gen = self.generation.get(rid, 1) - (1 if stale else 0)
        r = self.table.get(rid)
        ids = data.draw(st.lists(st.sampled_from(r.block_ids), min_size=1, unique=True)) if r else [0]
        verdict = self.table.write(rid, gen, f"P{peer}", ids)
        if verdict is Verdict.OK:
            live = self.table.get(rid)
            assert live.state == RangeState.WRITING and live.generation == gen
            assert all(self.table.held_blocks()[b] == rid for b in ids)
            self.writer.update({b: (rid, gen) for b in ids})
        if stale or f"P{peer}" not in self.peers:
            assert verdict is not Verdict.OK

    @rule(rid=rids, peer=st.integers(0, 3))
    def commit(self, rid, peer):
        r = self.table.get(rid)
        verdict = self.table.commit(rid, self.generation.get(rid, 1), f"P{peer}")
        if verdict is Verdict.OK:
            assert all(self.writer[b] == (rid, r.generation) for b in r.block_ids)  # every block fully ours

    @rule(rid=rids)
    def adopt(self, rid):
        r = self.table.get(rid)
        if r is not None and r.state == RangeState.COMMITTED:
            self.adopted |= set(self.table.adopt(rid))

    @rule(rid=rids, any_generation=st.booleans())
    def abort(self, rid, any_generation):
        self.table.abort(rid, None if any_generation else self.generation.get(rid, 1))

    @rule(seconds=st.sampled_from([1.0, 6.0, 11.0]))
    def tick(self, seconds):
        self.clock.now += seconds
        self.table.expire()

    @rule()
    def peer_restart(self):
        old = self.peers.pop()
        self.table.forget_peer(old)
        new = f"P{(int(old[1:]) + 1) % 4}"
        self.peers.append(new)
        self.table.register_peer(new)

    @precondition(lambda self: self.adopted)
    @rule()
    def request_finishes(self):
        self.blocks.release(sorted(self.adopted))
        self.adopted.clear()

    @invariant()
    def no_block_owned_twice_none_leaked(self):
        held = self.table.held_blocks()
        live_ids = [b for r in self.table.live() for b in r.block_ids]
        assert len(live_ids) == len(set(live_ids)) == len(held)
        free, adopted = set(self.blocks.free), self.adopted
        assert len(free) == len(self.blocks.free)
        assert not (free & set(held)) and not (free & adopted) and not (adopted & set(held))
        assert len(free) + len(held) + len(adopted) == NUM_BLOCKS

    @invariant()
    def every_live_range_has_a_future_deadline(self):
        assert all(r.lease_deadline > self.clock.now for r in self.table.live())


OwnershipMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_ownership_state_machine = OwnershipMachine.TestCase
