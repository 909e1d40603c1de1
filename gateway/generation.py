"""Runs the backend requests behind one HTTP request (``n`` x prompts choices) and merges their events.

Life cycle:
1. ``start``: every choice's generator is asked for its first event before the response begins, so
   "no capacity" is still a 503 (with Retry-After) and not an error inside a 200 stream.
2. ``deltas``: one pump task per choice feeds a queue; the consumer turns events into ``ChoiceDelta``s,
   records latency metrics, and aborts a choice whose text hit a stop string.
3. ``close`` (always, also on client disconnect): cancel pumps, ``abort`` every unfinished request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio

from .backend import Backend, GenerationRequest, NoCapacity, TokenEvent
from .choice import ChoiceDelta, ChoiceState
from .errors import APIError, no_capacity
from .metrics import GatewayMetrics

_MAX_ERROR_CHARS = 300


class GenerationFailed(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(500, f"generation failed: {message[:_MAX_ERROR_CHARS]}", code="generation_failed")


class Generation:
    __slots__ = ("_backend", "_requests", "states", "_metrics", "_gens", "_firsts", "_pumps", "_queue",
                 "_last_event_time", "_is_closed",
                 "num_choices_per_prompt")

    def __init__(self, backend: Backend, requests: list[GenerationRequest], states: list[ChoiceState],
                 metrics: GatewayMetrics, num_choices_per_prompt: int = 1) -> None:
        assert len(requests) == len(states) and len(states) % num_choices_per_prompt == 0
        self._backend = backend
        self._requests = requests
        self.states = states
        self._metrics = metrics
        self._gens: list = []
        self._firsts: list[TokenEvent] = []
        self._pumps: list[asyncio.Task] = []
        self._queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self._last_event_time: list[float | None] = [None] * len(states)
        self._is_closed = False
        self.num_choices_per_prompt = num_choices_per_prompt  # choices i*n .. i*n+n-1 share prompt i

    async def start(self) -> None:
        self._gens = [self._backend.generate(r) for r in self._requests]
        results = await asyncio.gather(*(self._first_event(g) for g in self._gens), return_exceptions=True)
        busy = [r for r in results if isinstance(r, NoCapacity)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # the caller closes: started generators are closed, every request aborted
            if busy:
                raise no_capacity(max(b.retry_after_s for b in busy), busy[0].reason)
            raise GenerationFailed(type(failed[0]).__name__ + ": " + str(failed[0]))
        self._firsts = results

    @staticmethod
    async def _first_event(gen) -> TokenEvent:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return TokenEvent(error="worker stream ended before the first token")

    async def deltas(self) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """(choice index, delta) until every choice is finished; raises GenerationFailed on a worker error."""
        self._pumps = [asyncio.create_task(self._pump(i, g, f))
                       for i, (g, f) in enumerate(zip(self._gens, self._firsts))]
        while not all(s.is_finished for s in self.states):
            i, event = await self._next_event()
            self._observe_latency(i, event)
            if event.error is not None:
                raise GenerationFailed(event.error)
            delta = self.states[i].feed(event)
            if delta.stopped_by_string:
                self._pumps[i].cancel()
                await self._backend.abort(self._requests[i].request_id)
            yield i, delta

    async def _next_event(self) -> tuple[int, TokenEvent]:
        deadline = self._requests[0].deadline  # one HTTP request: every choice shares the deadline
        if deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            waited = deadline - self._requests[0].arrival_time
            raise GenerationFailed(f"request timed out after {waited:.1f} s") from None

    async def _pump(self, i: int, gen, event: TokenEvent) -> None:
        try:
            while True:
                await self._queue.put((i, event))
                if event.finish_reason is not None or event.error is not None:
                    return
                event = await gen.__anext__()
        except StopAsyncIteration:
            await self._queue.put((i, TokenEvent(error="worker stream ended without a finish reason")))
        except Exception as e:  # a broken backend must surface as a clean error, not a hung request
            await self._queue.put((i, TokenEvent(error=f"{type(e).__name__}: {e}")))
        finally:
            await gen.aclose()

    def _observe_latency(self, i: int, event: TokenEvent) -> None:
        now = time.monotonic()
        last = self._last_event_time[i]
        if event.queue_time_s is not None:
            self._metrics.request_queue_time.observe(event.queue_time_s)
        if event.token_ids:
            if last is None:
                self._metrics.time_to_first_token.observe(now - self._requests[i].arrival_time)
            else:
                self._metrics.inter_token_latency.observe(now - last)
            self._last_event_time[i] = now

    async def close(self) -> bool:
        """Cancel pumps and abort unfinished requests; shielded, since it runs while being cancelled.

        Idempotent; True only for the call that actually closed."""
        if self._is_closed:
            return False
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            for task in self._pumps:
                task.cancel()
            for task in self._pumps:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
            if not self._pumps:
                for gen in self._gens:
                    await gen.aclose()
            for state, request in zip(self.states, self._requests):
                if not state.is_finished:
                    await self._backend.abort(request.request_id)
        return True
