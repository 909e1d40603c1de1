"""Receiver-side ownership of destination block ranges. Pure logic: no I/O, the clock is injected.

One range per request (``rid``) at a time::

    reserve ─▶ RESERVED ─write─▶ WRITING ─commit─▶ COMMITTED ─adopt─▶ RELEASED  (the request owns them)
                  │                 │                  │
                  └──── abort ──────┴──────────────────┴─▶ ABORTED   (blocks go back through ``release``)
                  └── lease runs out (any live state) ────▶ EXPIRED   (blocks go back through ``release``)

Invariants: a block is held by at most one live range; every block handed to ``reserve`` leaves
through exactly one of ``adopt`` (returned to the caller) or ``release`` (callback). A write must name
the live range's ``(rid, generation)`` and come from its sender incarnation, so a write that was in
flight when its range was aborted and the blocks reused is refused, never applied.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DEFAULT_LEASE_S = 30.0


class RangeState(enum.IntEnum):
    RESERVED = 0
    WRITING = 1
    COMMITTED = 2
    RELEASED = 3  # terminal states from here on
    EXPIRED = 4
    ABORTED = 5

    @property
    def is_live(self) -> bool:
        return self < RangeState.RELEASED


class Verdict(enum.Enum):
    OK = "ok"
    STALE = "stale"  # no live range for (rid, generation): aborted, expired, or an older generation
    UNKNOWN_INCARNATION = "unknown_incarnation"  # sender never handshaked, restarted, or is not the owner
    OUT_OF_RANGE = "out_of_range"  # block ids outside the reserved range
    INCOMPLETE = "incomplete"  # commit before every reserved block was written
    WRONG_STATE = "wrong_state"  # e.g. a write after commit
    NOT_ASSIGNED = "not_assigned"  # the writer's key is not the one the range was reserved for


class OwnershipError(RuntimeError):
    """A caller bug (double reservation of a block or a rid), not a peer's fault."""


@dataclass(slots=True)
class Reservation:
    rid: str
    generation: int
    block_ids: tuple[int, ...]
    sender_incarnation: str | None  # None: bound by the first accepted write
    lease_deadline: float
    reserved_at: float
    state: RangeState = RangeState.RESERVED
    written: set[int] = field(default_factory=set)
    first_write_at: float | None = None
    sender_key: str = ""  # the only peer key that may write or commit it ("": any, insecure plane)


class OwnershipTable:
    def __init__(
        self,
        release: Callable[[list[int]], None],
        clock: Callable[[], float] = time.monotonic,
        lease_s: float = DEFAULT_LEASE_S,
        max_tombstones: int = 4096,
    ):
        assert lease_s > 0
        self._release = release
        self._clock = clock
        self.lease_s = lease_s
        self._live: dict[str, Reservation] = {}
        self._owner_of: dict[int, str] = {}  # block id -> rid of the live range holding it
        self._peers: set[str] = set()
        # Ended ranges, newest last, so late frames are classified (and abort stays idempotent).
        self._ended: collections.OrderedDict[str, Reservation] = collections.OrderedDict()
        self._max_tombstones = max_tombstones
        self.num_rejected: collections.Counter[Verdict] = collections.Counter()
        self.num_expired = 0

    # -- peers --------------------------------------------------------------------------------
    def register_peer(self, incarnation: str) -> None:
        self._peers.add(incarnation)

    def forget_peer(self, incarnation: str) -> list[Reservation]:
        """The peer restarted or left: its writes are refused from now on and its ranges aborted."""
        self._peers.discard(incarnation)
        mine = [r for r in self._live.values() if r.sender_incarnation == incarnation]
        for r in mine:
            self._end(r, RangeState.ABORTED)
        return mine

    # -- receiver-side calls ------------------------------------------------------------------
    def reserve(
        self,
        rid: str,
        generation: int,
        block_ids: Iterable[int],
        sender_incarnation: str | None = None,
        sender_key: str = "",
    ) -> Reservation:
        ids = tuple(block_ids)
        if not ids or len(set(ids)) != len(ids):
            raise OwnershipError(f"reservation {rid!r} needs distinct block ids, got {ids}")
        if rid in self._live:
            raise OwnershipError(f"request {rid!r} already holds a live range")
        taken = [b for b in ids if b in self._owner_of]
        if taken:
            raise OwnershipError(f"blocks {taken} are already held by {self._owner_of[taken[0]]!r}")
        now = self._clock()
        r = Reservation(rid, generation, ids, sender_incarnation, now + self.lease_s, now, sender_key=sender_key)
        self._live[rid] = r
        self._ended.pop(rid, None)
        for b in ids:
            self._owner_of[b] = rid
        return r

    def adopt(self, rid: str) -> tuple[int, ...]:
        """COMMITTED -> RELEASED: the request on this node now owns the blocks (no release callback)."""
        r = self._live.get(rid)
        if r is None or r.state != RangeState.COMMITTED:
            raise OwnershipError(f"request {rid!r} has no committed range to adopt")
        self._end(r, RangeState.RELEASED)
        return r.block_ids

    def abort(self, rid: str, generation: int | None = None) -> bool:
        """Idempotent. A generation, when given, must match: an old abort never kills a retry."""
        r = self._live.get(rid)
        if r is None or (generation is not None and generation != r.generation):
            return False
        self._end(r, RangeState.ABORTED)
        return True

    def expire(self) -> list[Reservation]:
        now = self._clock()
        expired = [r for r in self._live.values() if r.lease_deadline <= now]
        for r in expired:
            self._end(r, RangeState.EXPIRED)
        self.num_expired += len(expired)
        return expired

    # -- sender-driven calls (each frame from the wire) --------------------------------------
    def write(self, rid: str, generation: int, incarnation: str, block_ids: Iterable[int], key: str = "") -> Verdict:
        """Check a write before its bytes are applied; on OK the blocks count as written."""
        ids = list(block_ids)
        r, verdict = self._check(rid, generation, incarnation, key)
        if verdict is Verdict.OK and r.state == RangeState.COMMITTED:
            verdict = Verdict.WRONG_STATE
        if verdict is Verdict.OK and any(self._owner_of.get(b) != rid for b in ids):
            verdict = Verdict.OUT_OF_RANGE
        if verdict is not Verdict.OK:
            self.num_rejected[verdict] += 1
            return verdict
        now = self._clock()
        r.sender_incarnation = incarnation
        r.state = RangeState.WRITING
        r.written.update(ids)
        r.first_write_at = now if r.first_write_at is None else r.first_write_at
        r.lease_deadline = now + self.lease_s  # progress renews the lease
        return verdict

    def commit(self, rid: str, generation: int, incarnation: str, key: str = "") -> Verdict:
        r, verdict = self._check(rid, generation, incarnation, key)
        if verdict is Verdict.OK and r.state == RangeState.COMMITTED:
            return verdict  # a retried commit is harmless
        if verdict is Verdict.OK and len(r.written) != len(r.block_ids):
            verdict = Verdict.INCOMPLETE
        if verdict is not Verdict.OK:
            self.num_rejected[verdict] += 1
            return verdict
        r.state = RangeState.COMMITTED
        r.sender_incarnation = incarnation
        r.lease_deadline = self._clock() + self.lease_s  # time for the decode node to adopt
        return verdict

    # -- inspection -------------------------------------------------------------------------
    def get(self, rid: str) -> Reservation | None:
        return self._live.get(rid) or self._ended.get(rid)

    def held_blocks(self) -> dict[int, str]:
        return dict(self._owner_of)

    def live(self) -> list[Reservation]:
        return list(self._live.values())

    # -- internals --------------------------------------------------------------------------
    def _check(self, rid: str, generation: int, incarnation: str, key: str) -> tuple[Reservation | None, Verdict]:
        if incarnation not in self._peers:
            return None, Verdict.UNKNOWN_INCARNATION
        r = self._live.get(rid)
        if r is None or r.generation != generation:
            return None, Verdict.STALE
        if r.sender_key and key != r.sender_key:
            return None, Verdict.NOT_ASSIGNED
        if r.sender_incarnation not in (None, incarnation):
            return None, Verdict.UNKNOWN_INCARNATION
        return r, Verdict.OK

    def _end(self, r: Reservation, state: RangeState) -> None:
        assert r.state.is_live and not state.is_live
        r.state = state
        del self._live[r.rid]
        for b in r.block_ids:
            del self._owner_of[b]
        self._ended[r.rid] = r
        while len(self._ended) > self._max_tombstones:
            self._ended.popitem(last=False)
        if state != RangeState.RELEASED:
            self._release(list(r.block_ids))
