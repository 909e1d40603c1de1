"""SIGTERM -> drain: the handler only sets a flag; the event loop does the work on its own thread."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable


def install_drain(handler: Callable[[], None], signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Call ``handler()`` (from the main thread, between bytecodes) on each of ``signals``.

    The handler must be quick and must not block: set a flag the event loop reads. Must be called
    from the main thread (Python's rule for signal handlers).
    """
    for sig in signals:
        signal.signal(sig, lambda signum, frame: handler())


class Drain:
    """A worker's drain as its loop sees it: *requested* (by the signal handler: the worker refuses new
    work from then on), *started* by the loop (the deadline is set), and *over* once nothing is in
    flight or the deadline has passed (the loop then fails what is left and says Goodbye)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self._clock = clock
        self.requested = False
        self._deadline: float | None = None

    def request(self) -> None:
        """Signal-safe: only sets a flag."""
        self.requested = True

    @property
    def started(self) -> bool:
        return self._deadline is not None

    def start_if_requested(self) -> bool:
        """True exactly once: on the loop's first turn after ``request``, when the deadline is set."""
        if not self.requested or self.started:
            return False
        self._deadline = self._clock() + self.timeout_s
        return True

    def is_over(self, in_flight: bool) -> bool:
        return self.started and (not in_flight or self._clock() >= self._deadline)
