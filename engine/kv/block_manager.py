"""Paged KV block manager: free list, ref counts, a hash-chained prefix cache, copy-on-write forks.

Every block is in exactly one of three sets:

    free     ref 0, no hash      handed out first, oldest-freed first (FIFO; initially 0, 1, 2, ...)
    cached   ref 0, hashed       reusable by a prefix hit; evicted only when ``free`` is empty
    in use   ref > 0             in the block table of a live sequence (or a reservation)

Eviction order of ``cached`` (the LRU queue; front is evicted first): blocks enter at the back when
their last reference is dropped, and a sequence drops its table *tail first*, so a chain's last block
is evicted before its parent and a whole chain released earlier goes before one released later. A
cached block that a new sequence reuses leaves the queue (ref 0 -> 1); it re-enters at the back when
released again.

Only full, computed blocks are hashed (``protocol.hashing.hash_block``, chained, the gateway's
function). A prefix hit never covers a sequence's last known token: the step must compute at least
that token to get the logits it samples from.

No I/O and no torch: callers see block ids and token counts. "Out of blocks" is ``can_allocate``
returning False, never an exception.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.sched.sequence import Sequence
from protocol.hashing import block_hashes, hash_block, lora_identity, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching  # off: no block is ever hashed or reused
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # hash of a block registered in the cache
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; front = next victim
        self._cache: dict[int, int] = {}  # block hash -> block id (in use or evictable)
        self._live: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks (for integrity checks)
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chained hashes of its full blocks (memo)
        self._num_hashed: dict[int, int] = {}  # seq_id -> leading table blocks already offered to the cache
        self.num_prefix_query_tokens = 0  # tokens looked up on first allocation (prefix_cache_queries)
        self.num_prefix_hit_tokens = 0  # of those, tokens taken from the cache (prefix_cache_hits)
        self.num_evicted_blocks = 0

    # ---- counters ----
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still in the prefix cache (reusable, evictable)."""
        return len(self._evictable)

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_live_slots(self) -> int:
        """Slots of in-use blocks that hold (or are reserved for) a token of a live sequence; a block
        shared by several sequences counts once. Over ``num_in_use_blocks * block_size`` it is the KV
        memory utilisation: what paging wastes is each sequence's partly filled last block."""
        bs = self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}  # block -> most slots any sharer fills
        for seq in self._live.values():
            num_full = min(len(seq.block_table), seq.num_tokens // bs)
            full.update(seq.block_table[:num_full])
            if num_full < len(seq.block_table) and (rest := seq.num_tokens - num_full * bs) > 0:
                block = seq.block_table[num_full]
                partial[block] = max(partial.get(block, 0), rest)
        return len(full) * bs + sum(n for block, n in partial.items() if block not in full)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (kv_cache_usage_perc)."""
        return self.num_in_use_blocks / self.num_blocks

    # ---- prefix cache lookups (read-only) ----
    def match_prefix(self, token_ids: list[int], cache_salt: str = "", lora: str = "") -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of ``token_ids``: (block ids, tokens covered).

        Read-only: no counters, no ref counts. Covers every full block of ``token_ids``; callers that
        must compute the last token pass ``token_ids[:-1]`` (``allocate`` does).
        """
        return self._walk(block_hashes(token_ids, self.block_size, cache_salt, lora))

    def prefix_hit(self, seq: Sequence) -> tuple[list[int], int]:
        """What ``allocate`` would reuse for ``seq`` now: full blocks within its first num_tokens - 1 tokens
        (none for a sequence that needs its prompt logprobs: those come only from computing the prompt)."""
        if seq.needs_prompt_logprobs:
            return [], 0
        num_full = (seq.num_tokens - 1) // self.block_size
        return self._walk(self._seq_hashes(seq, num_full)[:num_full])

    def _walk(self, hashes: list[int]) -> tuple[list[int], int]:
        blocks: list[int] = []
        for h in hashes:
            block = self._cache.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _seq_hashes(self, seq: Sequence, num_full: int) -> list[int]:
        # Tokens are only ever appended, so hashes of a sequence's full blocks can be memoized.
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs, params = self.block_size, seq.params
        while len(hashes) < num_full:
            parent = (
                hashes[-1]
                if hashes
                else root_hash(params.cache_salt, lora_identity(params.lora_name, params.lora_path, params.lora_digest))
            )
            start = len(hashes) * bs
            hashes.append(hash_block(parent, seq.token_ids[start : start + bs]))
        return hashes

    # ---- allocation ----
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``allocate(seq, num_new_tokens)`` would find enough blocks."""
        if not seq.block_table:
            hit_blocks, hit_tokens = self.prefix_hit(seq)
            needed = cdiv(hit_tokens + num_new_tokens, self.block_size) - len(hit_blocks)
            revived = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)  # leave the evictable set
            return needed <= self.num_allocatable_blocks - revived
        needed = max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table))
        needed += len(self._shared_in_write_range(seq, num_new_tokens))
        return needed <= self.num_allocatable_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make ``seq.block_table`` cover ``num_computed_tokens + num_new_tokens`` tokens.

        On the first allocation (empty table) the longest cached prefix is reused first, setting
        ``num_cached_tokens`` and ``num_computed_tokens``; ``num_new_tokens`` counts from there.
        A shared block about to be written is replaced by a private one (copy-on-write); returns the
        (src, dst) block copies the runner must do before the step. Call ``can_allocate`` first.
        """
        assert self.can_allocate(seq, num_new_tokens), "allocate without can_allocate"
        if not seq.block_table:
            assert seq.num_computed_tokens == 0, "a sequence without blocks has no computed tokens"
            hit_blocks, hit_tokens = self.prefix_hit(seq)
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += hit_tokens
            for block in hit_blocks:
                self._take(block)
            seq.block_table = list(hit_blocks)
            seq.num_computed_tokens = hit_tokens
            seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)
            self._num_hashed[seq.seq_id] = len(hit_blocks)
            self._live[seq.seq_id] = seq
        copies = []
        first_written = seq.num_computed_tokens // self.block_size
        for index in self._shared_in_write_range(seq, num_new_tokens):
            old, new = seq.block_table[index], self._pop_block()
            self.ref_counts[old] -= 1  # still > 0: another sequence holds it
            seq.block_table[index] = new
            if index == first_written and seq.num_computed_tokens % self.block_size:
                copies.append((old, new))  # tokens before the write start must come along
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._pop_block())
        return copies

    def can_reserve(self, seq: Sequence, num_tokens: int, num_spare_blocks: int = 0) -> bool:
        """Whether ``reserve(seq, num_tokens)`` would succeed with ``num_spare_blocks`` left over
        (room to decode after a transfer)."""
        assert not seq.block_table, "reserve is for a sequence holding no blocks"
        _, hit_tokens = self.prefix_hit(seq)
        return self.can_allocate(seq, max(num_tokens - hit_tokens, 0) + num_spare_blocks * self.block_size)

    def reserve(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Blocks for ``seq``'s first ``num_tokens`` tokens without scheduling any compute; returns the
        new blocks (after the prefix hit): where another node writes the missing KV.

            token_ids: [ prefix hit (num_computed_tokens) | reserved, uncomputed | ... ]
                       0                                  hit                    num_tokens
        Call ``can_reserve`` first; ``mark_computed`` once the KV has arrived.
        """
        assert not seq.block_table, "reserve is for a sequence holding no blocks"
        _, hit_tokens = self.prefix_hit(seq)
        self.allocate(seq, max(num_tokens - hit_tokens, 0))
        return seq.block_table[hit_tokens // self.block_size :]

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of ``seq``'s first ``num_tokens`` tokens is in its blocks (written by a transfer):
        count them computed and offer the full ones to the prefix cache."""
        assert len(seq.block_table) >= cdiv(num_tokens, self.block_size), "blocks do not cover the tokens"
        assert seq.num_computed_tokens <= num_tokens < seq.num_tokens, (seq.num_computed_tokens, num_tokens)
        seq.num_computed_tokens = num_tokens
        self.cache_full_blocks(seq)

    def free_unused_tail(self, seq: Sequence) -> None:
        """Free the table's blocks past those covering ``num_computed_tokens``: blocks allocated for
        speculative tokens that were rejected. They hold no computed token, so none is hashed or shared."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None, block
            self.ref_counts[block] = 0
            self._free.append(block)

    def _shared_in_write_range(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        # Table indices that this step writes into and that another sequence also references.
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        end = min(len(seq.block_table), cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return [i for i in range(first, end) if self.ref_counts[seq.block_table[i]] > 1]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share ``parent``'s blocks with ``child`` (ref +1 each); later writes copy-on-write."""
        assert not child.block_table and child.seq_id not in self._live, "fork into a fresh sequence"
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self._num_hashed[child.seq_id] = self._num_hashed.get(parent.seq_id, 0)
        self._live[child.seq_id] = child

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s newly computed full blocks in the prefix cache.

        A block whose hash is already cached (another sequence computed the same prefix at the same
        time) stays private and is freed, not cached, on release.
        """
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_hashed.get(seq.seq_id, 0)
        if num_full <= start or not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes(seq, num_full)
        for index in range(start, num_full):
            h, block = hashes[index], seq.block_table[index]
            if h not in self._cache and self.block_hash[block] is None:
                self._cache[h] = block
                self.block_hash[block] = h
        self._num_hashed[seq.seq_id] = num_full

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first: hashed ones stay cached, the rest are freed.

        Leaves the sequence with an empty table and no computed tokens. Safe on a sequence that holds
        no blocks.
        """
        if seq.block_table:
            self.cache_full_blocks(seq)
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, block
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._live.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._num_hashed.pop(seq.seq_id, None)

    def _take(self, block: int) -> None:
        # A prefix hit: reference a cached block, pulling it out of the evictable set if idle.
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _pop_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self.block_hash[block]]
            self.block_hash[block] = None
            self.num_evicted_blocks += 1
        self.ref_counts[block] = 1
        return block

    # ---- invariants ----
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + in use == total and ref counts match the tables."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"block manager integrity: {what}")

        free, cached = set(self._free), set(self._evictable)
        require(len(free) == len(self._free), "a block is on the free list twice")
        require(not free & cached, f"blocks both free and cached: {sorted(free & cached)}")
        expected = [0] * self.num_blocks
        for seq in self._live.values():
            require(len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} holds a block twice")
            require(
                len(seq.block_table) >= cdiv(seq.num_computed_tokens, self.block_size),
                f"seq {seq.seq_id} table does not cover its computed tokens",
            )
            for block in seq.block_table:
                expected[block] += 1
        require(expected == self.ref_counts, "ref counts differ from the live block tables")
        for block in range(self.num_blocks):
            num_sets = (self.ref_counts[block] > 0) + (block in free) + (block in cached)
            require(num_sets == 1, f"block {block} is in {num_sets} of free/cached/in-use")
            require(block not in free or self.block_hash[block] is None, f"free block {block} is hashed")
            require(block not in cached or self.block_hash[block] is not None, f"cached block {block} has no hash")
        for h, block in self._cache.items():
            require(self.block_hash[block] == h, f"cache entry of block {block} disagrees with its hash")
        require(sum(h is not None for h in self.block_hash) == len(self._cache), "hashed blocks missing from cache")
        require(len(free) + len(cached) + self.num_in_use_blocks == self.num_blocks, "counts do not add up")
