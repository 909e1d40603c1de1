"""Background responses: the Responses API's ``background: true``, as OpenAI and vLLM serve it.

1. POST answers at once with the response ``queued`` (stored); its generation runs on in a task here
2. the task stores it ``in_progress`` once the workers have it, then ``completed``, ``incomplete`` or
   ``failed``; ``GET /v1/responses/{id}`` reads it from the store at any point
3. ``POST .../cancel`` (or ``DELETE``) stops one still running: its workers' requests are aborted and it
   is stored ``cancelled``. Cancelling one that ended returns it as it ended
4. gateway shutdown cancels what still runs: a background response outlives its HTTP request, never
   its gateway
5. behind several replicas sharing a Redis store, a cancel that reaches another replica is published
   there, and this one stops the response if it runs it (``cancel_soon``)

Cancelling goes through an anyio cancel scope, not ``Task.cancel``: the scope reaches the work even
where it has not taken its first step yet (a cancelled task that never started skips its own cleanup),
and it leaves the shielded close (``Generation.close``) alone, so the request is always released and
counted once, however many cancels arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass

import anyio


@dataclass(slots=True)
class _Running:
    task: asyncio.Task  # the response's generation
    scope: anyio.CancelScope  # cancelling it stops the generation


class BackgroundResponses:
    def __init__(self) -> None:
        self._running: dict[str, _Running] = {}  # response id -> its generation, until it has ended

    def __len__(self) -> int:
        return len(self._running)

    def start(self, response_id: str, work: Coroutine) -> None:
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await work

        task = asyncio.create_task(run(), name=f"background-response-{response_id}")
        self._running[response_id] = _Running(task, scope)
        task.add_done_callback(lambda _: self._running.pop(response_id, None))

    async def cancel(self, response_id: str) -> bool:
        """Stop it and wait until it has stored itself cancelled; False where it is not running."""
        running = self._running.get(response_id)
        if running is None:
            return False
        running.scope.cancel()
        await asyncio.wait([running.task])
        return True

    def cancel_soon(self, response_id: str) -> None:
        """Another replica was asked to cancel it: stop it if it runs here (it stores itself cancelled)."""
        running = self._running.get(response_id)
        if running is not None:
            running.scope.cancel()

    async def cancel_all(self) -> None:
        await asyncio.gather(*(self.cancel(response_id) for response_id in list(self._running)))
