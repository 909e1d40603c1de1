"""Puts the token events of a request's completions back in order, by ``offset``, per completion.

The first token of a disaggregated request comes from the prefill worker (offset 0) and the rest from the
decode worker (offset 1, 2, ...), over two different connections, so they may arrive in either order:

    completion j:  [ offset 0 (P) | offset 1 .. (D) ... ]   next_offset[j] = tokens of j released so far

An event at ``next_offset`` is released (with any buffered events it unblocks); a later one waits; an
earlier one is a duplicate and dropped. Nothing is released after a completion's finishing event.
"""

from __future__ import annotations

from protocol.serving import TokenEvent


class CompletionOrder:
    __slots__ = ("_next_offset", "_pending", "_finished")

    def __init__(self, n: int) -> None:
        self._next_offset = [0] * n
        self._pending: list[dict[int, list[TokenEvent]]] = [{} for _ in range(n)]  # offset -> waiting events
        self._finished = [False] * n

    @property
    def is_finished(self) -> bool:
        return all(self._finished)

    def push(self, event: TokenEvent) -> list[TokenEvent]:
        """The events now releasable in order; raises ValueError for an index outside 0 .. n-1."""
        j = event.index
        if not 0 <= j < len(self._next_offset):
            raise ValueError(f"completion index {j} outside 0..{len(self._next_offset) - 1}")
        if self._finished[j] or event.offset < self._next_offset[j]:
            return []
        self._pending[j].setdefault(event.offset, []).append(event)
        released: list[TokenEvent] = []
        while not self._finished[j] and self._next_offset[j] in self._pending[j]:
            # at one offset: events without tokens (a bare finish, cache info) first, then one with tokens
            waiting = sorted(self._pending[j].pop(self._next_offset[j]), key=lambda e: len(e.token_ids) > 0)
            for e in waiting:
                if released and released[-1].token_ids and e.token_ids and e.offset == released[-1].offset:
                    continue  # a second event with tokens at the same offset: a duplicate
                released.append(e)
                self._next_offset[j] = e.offset + len(e.token_ids)
                self._finished[j] = bool(e.finish_reason or e.error)
                if self._finished[j] or e.token_ids:
                    break
        return released
