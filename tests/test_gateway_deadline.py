"""The gateway's waits end on their deadline and never drop a cancel.

The cancel matters: ``asyncio.wait_for`` (Python < 3.12) returned the item and dropped the cancel when a
client hung up in the same loop turn as a token arrived, so the request ran to its last token.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.deadline import get_by
from gateway.workers.admission import AdmissionQueue


def run(coro):
    return asyncio.run(coro)


def test_get_by_returns_the_item_or_times_out_at_the_deadline():
    async def main():
        q: asyncio.Queue[int] = asyncio.Queue()
        q.put_nowait(7)
        assert await get_by(q, None) == 7
        q.put_nowait(8)
        assert await get_by(q, time.monotonic() - 1) == 8  # an item already there, even past the deadline
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await get_by(q, started + 0.05)
        return time.monotonic() - started

    assert 0.05 <= run(main()) < 1.0


@pytest.mark.parametrize("deadline_s", [None, 60.0])
def test_get_by_keeps_a_cancel_that_lands_with_the_item(deadline_s):
    async def main():
        for _ in range(20):
            q: asyncio.Queue[int] = asyncio.Queue()
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            waiter = asyncio.create_task(get_by(q, deadline))
            await asyncio.sleep(0)  # waiting on the queue
            q.put_nowait(1)  # the token arrives ...
            waiter.cancel()  # ... in the same loop turn as the client's hang-up
            with pytest.raises(asyncio.CancelledError):
                await waiter

    run(main())


def test_admission_wait_keeps_a_cancel_that_lands_with_the_notify():
    async def main():
        for _ in range(20):
            queue = AdmissionQueue(max_waiting=1)
            waiter = asyncio.create_task(queue.wait(60.0))
            await asyncio.sleep(0)
            queue.notify()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert len(queue) == 0

    run(main())


def test_admission_wait_times_out():
    async def main():
        queue = AdmissionQueue(max_waiting=1)
        assert await queue.wait(0.01) is False
        assert len(queue) == 0

    run(main())
