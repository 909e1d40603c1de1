"""Block manager: exact block ids for allocation, prefix hits, eviction order and copy-on-write."""

from engine.kv.block_manager import BlockManager
from engine.sampling.params import SamplingParams
from engine.sched.sequence import Sequence
from protocol.hashing import block_hashes
from tests.invariants import assert_block_counts, assert_integrity, assert_no_leak


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int) -> list[tuple[int, int]]:
    """What one step does to a sequence: allocate, (runner writes KV), advance, cache full blocks."""
    assert bm.can_allocate(seq, n)
    copies = bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return copies


def test_allocation_and_growth():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, list(range(10)))
    assert compute(bm, a, 10) == []
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert_block_counts(bm, free=5, cached=0, in_use=3)
    # Decode tokens 10 and 11 fit in block 2; token 12 opens block 3.
    for token in (10, 11, 12):
        a.token_ids.append(token)
        compute(bm, a, 1)
    assert a.block_table == [0, 1, 2, 3] and a.num_computed_tokens == 13
    assert [bm.block_hash[b] for b in a.block_table] == [*block_hashes(a.token_ids, 4), None]
    bm.deallocate(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    # Full blocks stay cached (released tail first), the partial one is freed at the back of the list.
    assert list(bm._evictable) == [2, 1, 0]
    assert list(bm._free) == [4, 5, 6, 7, 3]
    assert_block_counts(bm, free=5, cached=3, in_use=0)
    assert_no_leak(bm)


def test_prefix_hit_on_second_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, list(range(10)))
    compute(bm, a, 10)
    b = make_seq(1, list(range(8)) + [100, 101, 102])
    assert bm.match_prefix(b.token_ids) == ([0, 1], 8)
    assert bm.can_allocate(b, 3)
    assert bm.allocate(b, 3) == []
    assert b.block_table == [0, 1, 3]
    assert (b.num_cached_tokens, b.num_computed_tokens) == (8, 8)
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (10 + 11, 8)
    assert_block_counts(bm, free=4, cached=0, in_use=4)
    b.num_computed_tokens += 3
    bm.cache_full_blocks(b)
    bm.deallocate(a)  # blocks 0 and 1 are still b's: only a's partial block 2 is freed
    assert_block_counts(bm, free=5, cached=0, in_use=3)
    bm.deallocate(b)
    assert list(bm._evictable) == [1, 0]
    assert list(bm._free) == [4, 5, 6, 7, 2, 3]
    assert_no_leak(bm)


def test_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, list(range(8)))
    compute(bm, a, 8)
    bm.deallocate(a)
    assert list(bm._evictable) == [1, 0]
    # The same 8-token prompt: both blocks are cached, but only the first is reused, so the step
    # computes tokens 4..7 and gets logits for token 7.
    c = make_seq(1, list(range(8)))
    assert bm.match_prefix(c.token_ids) == ([0, 1], 8)  # read-only lookup sees the whole prefix
    assert bm.prefix_hit(c) == ([0], 4)
    assert bm.can_allocate(c, 4)
    bm.allocate(c, 4)
    assert c.block_table == [0, 2] and (c.num_cached_tokens, c.num_computed_tokens) == (4, 4)
    assert_block_counts(bm, free=5, cached=1, in_use=2)  # block 1 stays cached, idle
    c.num_computed_tokens = 8
    bm.cache_full_blocks(c)  # the hash of block 1 is taken: block 2 stays private (freed on release)
    assert bm.block_hash[2] is None
    bm.deallocate(c)
    assert list(bm._evictable) == [1, 0] and list(bm._free) == [3, 4, 5, 6, 7, 2]
    assert_no_leak(bm)


def test_eviction_order_is_lru_tails_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(0, [1] * 8)
    compute(bm, a, 8)  # blocks 0, 1
    b = make_seq(1, [2] * 9)
    compute(bm, b, 9)  # blocks 2, 3 full, 4 partial
    bm.deallocate(a)
    bm.deallocate(b)
    assert list(bm._evictable) == [1, 0, 3, 2] and list(bm._free) == [5, 4]
    # A hit takes a's chain out of the evictable set; released again it goes to the back.
    d = make_seq(2, [1] * 8 + [7])
    compute(bm, d, 1)
    assert d.block_table == [0, 1, 5] and d.num_cached_tokens == 8
    assert_block_counts(bm, free=1, cached=2, in_use=3)
    bm.deallocate(d)
    assert list(bm._evictable) == [3, 2, 1, 0] and list(bm._free) == [4, 5]
    # 5 fresh blocks: the free list first, then b's chain tail first, then a's tail.
    e = make_seq(3, [9] * 20)
    assert bm.can_allocate(e, 20)
    bm.allocate(e, 20)
    assert e.block_table == [4, 5, 3, 2, 1]
    assert bm.num_evicted_blocks == 3
    assert bm.match_prefix([2] * 9) == ([], 0)
    assert bm.match_prefix([1] * 8) == ([0], 4)
    assert not bm.can_allocate(make_seq(4, [5] * 8), 8)  # one block left: "no" is a return value
    bm.deallocate(e)
    assert_no_leak(bm)


def test_hit_on_idle_cached_block_is_not_counted_as_allocatable():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(0, [1] * 8)
    compute(bm, a, 8)
    bm.deallocate(a)  # 1 free, 2 idle cached
    b = make_seq(1, [1] * 8 + [2] * 9)  # reuses both cached blocks, then needs 3 more
    assert bm.prefix_hit(b) == ([0, 1], 8)
    assert not bm.can_allocate(b, 9)
    c = make_seq(2, [1] * 8 + [2] * 4)  # reuses 2, needs 1 more
    assert bm.can_allocate(c, 4)
    bm.allocate(c, 4)
    assert c.block_table == [0, 1, 2]
    assert_block_counts(bm, free=0, cached=0, in_use=3)
    bm.deallocate(c)
    assert_no_leak(bm)


def test_copy_on_write_fork():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, list(range(6)))
    compute(bm, parent, 6)  # [0, 1]; block 1 holds tokens 4, 5
    child = make_seq(-1, list(range(6)))
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.num_computed_tokens == 6
    assert bm.ref_counts[:2] == [2, 2]
    assert_block_counts(bm, free=6, cached=0, in_use=2)
    parent.token_ids.append(50)
    child.token_ids.append(60)
    # The parent writes token 6 into shared block 1: it gets block 2, a copy of block 1.
    assert bm.can_allocate(parent, 1)
    assert compute(bm, parent, 1) == [(1, 2)]
    assert parent.block_table == [0, 2] and bm.ref_counts[:3] == [2, 1, 1]
    # The child is now block 1's only owner: it writes in place.
    assert compute(bm, child, 1) == []
    assert child.block_table == [0, 1]
    assert_block_counts(bm, free=5, cached=0, in_use=3)
    bm.deallocate(parent)
    bm.deallocate(child)
    assert list(bm._free) == [3, 4, 5, 6, 7, 2, 1] and list(bm._evictable) == [0]
    assert_no_leak(bm)


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, list(range(8)))
    compute(bm, parent, 8)
    child = make_seq(-1, list(range(8)))
    bm.fork(parent, child)
    parent.token_ids.append(1)
    child.token_ids.append(2)
    assert compute(bm, parent, 1) == [] and compute(bm, child, 1) == []
    assert parent.block_table == [0, 1, 2] and child.block_table == [0, 1, 3]
    assert_block_counts(bm, free=4, cached=0, in_use=4)
    bm.deallocate(child)
    bm.deallocate(parent)
    assert_no_leak(bm)


def test_same_prompt_computed_twice_caches_one_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(0, list(range(9))), make_seq(1, list(range(9)))
    bm.allocate(a, 9)
    bm.allocate(b, 9)  # neither is computed yet: no hit
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_full_blocks(seq)
    assert bm.match_prefix(list(range(9))) == ([0, 1], 8)
    bm.deallocate(b)  # its duplicates were never cached: freed
    assert_block_counts(bm, free=5, cached=0, in_use=3)
    bm.deallocate(a)
    assert_block_counts(bm, free=6, cached=2, in_use=0)
    assert_no_leak(bm)


def test_integrity_check_catches_a_double_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(0, list(range(4)))
    bm.allocate(a, 4)
    a.block_table.append(a.block_table[0])  # a corrupt table
    try:
        bm.check_integrity()
    except AssertionError as e:
        assert "twice" in str(e)
    else:
        raise AssertionError("check_integrity missed a block owned twice")
    a.block_table.pop()
    assert_integrity(bm)
    bm.deallocate(a)
    assert_no_leak(bm)


def test_live_slots_count_each_block_once_and_only_live_tokens():
    """KV utilisation's numerator: tokens in in-use blocks, a shared block counted once."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(10)))
    compute(bm, a, 10)  # blocks [0, 1, 2]: 4 + 4 + 2 live slots
    assert bm.num_live_slots == 10 and bm.num_in_use_blocks * 4 == 12
    b = make_seq(1, list(range(8)) + [100, 101, 102])
    compute(bm, b, 3)  # shares full blocks 0 and 1; its own block 3 holds 3 tokens
    assert b.block_table == [0, 1, 3]
    assert bm.num_live_slots == 10 + 3
    child = make_seq(-1, list(b.token_ids))
    bm.fork(b, child)  # shares b's partial block 3 too: counted once
    assert bm.num_live_slots == 13
    child.token_ids.append(7)
    compute(bm, child, 1)  # copy-on-write: block 4 holds 4 tokens, b's block 3 still 3
    assert child.block_table == [0, 1, 4] and bm.num_live_slots == 13 + 4
    r = make_seq(2, list(range(200, 209)))
    assert bm.reserve(r, 9) == [5, 6, 7]  # reserved for 9 tokens another node will write
    assert bm.num_live_slots == 17 + 9 and bm.num_in_use_blocks == 8
    for seq in (a, b, child, r):
        bm.deallocate(seq)
    assert bm.num_live_slots == 0
    assert_no_leak(bm)
