"""Waiting on a queue until a deadline without losing a cancel.

``asyncio.wait_for`` before Python 3.12 returns the item and drops the cancel when both land in the
same loop turn. For the gateway that meant a client who hung up while a token arrived was never
noticed: the request decoded to its last token on a worker nobody listened to.
"""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

T = TypeVar("T")


async def get_by(queue: asyncio.Queue[T], deadline: float | None) -> T:
    """The next item of ``queue``; TimeoutError once the ``time.monotonic`` deadline passes (None: none)."""
    if deadline is None:
        return await queue.get()
    if not queue.empty():  # no wait, so no timer to arm (one per token of a stream otherwise)
        return queue.get_nowait()
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        return await queue.get()
