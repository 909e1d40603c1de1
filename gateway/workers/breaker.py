"""A circuit breaker per worker: a worker that keeps failing gets no new requests for a while.

After ``threshold`` consecutive failures (lost before the first token, send refused, error event) the
breaker opens for ``cooldown_s``; then requests flow again and the next result decides: a success closes
it (count reset), a failure reopens it at once. Pure bookkeeping; the caller passes the clock.
"""

from __future__ import annotations


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown_s: float = 10.0) -> None:
        assert threshold >= 1 and cooldown_s >= 0
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._failures: dict[str, int] = {}  # consecutive failures per worker id
        self._opened_at: dict[str, float] = {}

    def record_failure(self, worker_id: str, now: float) -> None:
        count = self._failures.get(worker_id, 0) + 1
        self._failures[worker_id] = count
        if count >= self._threshold:
            self._opened_at[worker_id] = now

    def record_success(self, worker_id: str) -> None:
        self._failures.pop(worker_id, None)
        self._opened_at.pop(worker_id, None)

    def is_open(self, worker_id: str, now: float) -> bool:
        opened = self._opened_at.get(worker_id)
        return opened is not None and now - opened < self._cooldown_s

    def tripped(self) -> list[str]:
        """Workers whose breaker opened and has not closed by a success since (open, or cooling down)."""
        return list(self._opened_at)

    def open_workers(self, now: float) -> set[str]:
        return {w for w in self._opened_at if self.is_open(w, now)}

    def forget(self, worker_id: str) -> None:
        """The worker left the registry; a new process under the same id starts with a clean record."""
        self.record_success(worker_id)
