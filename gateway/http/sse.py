"""Server-sent events response that notices a client disconnect at once.

Starlette's StreamingResponse only notices a disconnect when a write fails and leaves the body generator
to the garbage collector. Here a listener waits for ``http.disconnect`` next to the writer; whichever ends
first cancels the other, and the event generator is always closed, so its ``finally`` (which aborts the
backend requests) runs before the handler returns.

While no event comes for ``keepalive_s`` (a request queued, prefilling, or preempted), a ``: keep-alive``
comment goes out, which SSE clients ignore: proxies and load balancers with idle timeouts keep the
connection, and a client that is gone shows up as a failed write.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio

from .errors import APIError

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def sse_named_event(name: str, payload: dict) -> bytes:
    """An event with its name on an ``event:`` line, as the Responses API streams them."""
    return b"event: " + name.encode("utf-8") + b"\n" + sse_event(payload)


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client goes away (the request body must already be consumed)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse:
    """An ASGI app streaming ``events`` (already framed as SSE bytes) with status 200."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]],
        keepalive_s: float | None = None,
    ) -> None:
        self._events = events
        self._on_close = on_close  # idempotent cleanup; also runs if ``events`` never started
        self._keepalive_s = keepalive_s or math.inf  # None or 0: never

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async with anyio.create_task_group() as tg:
                # fast_acquire: a free lock is taken without yielding to the event loop first (the
                # default yields on every write, once per token of every stream)
                lock, last_write = anyio.Lock(fast_acquire=True), [time.monotonic()]

                async def send_body(chunk: bytes, more: bool = True) -> None:
                    async with lock:  # a keep-alive never lands inside another write
                        await send({"type": "http.response.body", "body": chunk, "more_body": more})
                        last_write[0] = time.monotonic()

                async def keep_alive() -> None:
                    try:
                        while True:
                            await anyio.sleep(last_write[0] + self._keepalive_s - time.monotonic())
                            if time.monotonic() - last_write[0] >= self._keepalive_s:
                                await send_body(KEEPALIVE)
                    except OSError:
                        tg.cancel_scope.cancel()  # the client went away

                async def write() -> None:
                    try:
                        async for chunk in self._events:
                            await send_body(chunk)
                        await send_body(b"", more=False)
                    except OSError:
                        pass  # the client went away mid-write
                    finally:
                        tg.cancel_scope.cancel()

                if self._keepalive_s != math.inf:
                    tg.start_soon(keep_alive)
                tg.start_soon(write)
                await wait_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close()


def error_event(e: APIError) -> bytes:
    """An error after the stream started: OpenAI clients raise it from the ``error`` key."""
    return sse_event(e.body())
