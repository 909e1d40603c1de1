"""When the next Heartbeat is due. The first one is due at once: it registers the worker."""

from __future__ import annotations

import time
from collections.abc import Callable


class HeartbeatTimer:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        assert interval_s > 0, interval_s
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock()

    def due(self) -> bool:
        """True once per interval (and at the first call); the caller sends a Heartbeat then."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def fire_now(self) -> None:
        """Make the next ``due`` true (state changed: draining, capacity freed...)."""
        self._next = self._clock()

    def seconds_left(self) -> float:
        return max(self._next - self._clock(), 0.0)
