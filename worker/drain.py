"""SIGTERM -> drain: the handler only sets a flag; the event loop does the work on its own thread."""

from __future__ import annotations

import signal
from collections.abc import Callable


def install_drain(handler: Callable[[], None], signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Call ``handler()`` (from the main thread, between bytecodes) on each of ``signals``.

    The handler must be quick and must not block: set a flag the event loop reads. Must be called
    from the main thread (Python's rule for signal handlers).
    """
    for sig in signals:
        signal.signal(sig, lambda signum, frame: handler())
