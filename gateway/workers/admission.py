"""A bounded queue of requests waiting for room in one worker pool.

When every decode worker lacks KV headroom, a request waits here (at most ``max_waiting`` of them, each
at most its timeout) until something may have freed room: a heartbeat, a finished request. Waiters are
all woken and re-route; whoever no longer fits waits again. Beyond the bound the answer is 503 at once.
"""

from __future__ import annotations

import asyncio


class AdmissionQueue:
    def __init__(self, max_waiting: int) -> None:
        assert max_waiting >= 0
        self.max_waiting = max_waiting
        self._waiters: set[asyncio.Future] = set()

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def is_full(self) -> bool:
        return len(self._waiters) >= self.max_waiting

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the next ``notify``; False on timeout. The caller checks ``is_full`` first."""
        assert not self.is_full
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:  # not asyncio.wait_for, which can drop a cancel (see deadline.py)
            async with asyncio.timeout(max(0.0, timeout_s)):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(waiter)

    def notify(self) -> None:
        """Room may have freed up: wake every waiter to route again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
