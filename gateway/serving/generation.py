"""Runs the backend requests behind one HTTP request (one per prompt, n completions each) and merges them.

    choices:  [ prompt 0: completion 0 .. n-1 | prompt 1: completion 0 .. n-1 | ... ]
              choice i = request i // n, event index i % n

Life cycle:
1. ``start``: every request's generator is asked for its first event before the response begins, so
   "no capacity" is still a 503 (with Retry-After), and a worker's refusal of an invalid request (a
   grammar that does not compile, say) a 400, not an error inside a 200 stream.
2. ``deltas``: one pump task per request feeds a queue; the consumer routes each event to its choice by
   ``index``, turns it into a ``ChoiceDelta``, records latency metrics, and aborts a request once every
   one of its choices is over (a stop string may end a choice before the worker does).
3. ``close`` (always, also on client disconnect): cancel pumps, ``abort`` every unfinished request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio

from gateway.deadline import get_by
from gateway.http.errors import APIError, bad_request, no_capacity
from gateway.metrics import ChoiceTiming, GatewayMetrics
from gateway.workers.backend import Backend, CompletionEvent, GenerationRequest, NoCapacity

from .choice import ChoiceDelta, ChoiceState

_MAX_ERROR_CHARS = 300


class GenerationFailed(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(500, f"generation failed: {message[:_MAX_ERROR_CHARS]}", code="generation_failed")


class Generation:
    __slots__ = (
        "_backend",
        "_requests",
        "states",
        "_metrics",
        "_gens",
        "_firsts",
        "_pumps",
        "_queue",
        "_last_event_time",
        "_first_token_time",
        "_queue_time",
        "_is_closed",
        "num_choices_per_prompt",
        "worker_ids",
        "request_id",
    )

    def __init__(
        self,
        backend: Backend,
        requests: list[GenerationRequest],
        states: list[ChoiceState],
        metrics: GatewayMetrics,
        num_choices_per_prompt: int = 1,
        request_id: str = "",
    ) -> None:
        assert len(states) == len(requests) * num_choices_per_prompt
        self._backend = backend
        self._requests = requests
        self.states = states
        self._metrics = metrics
        self._gens: list = []
        self._firsts: list[CompletionEvent] = []
        self._pumps: list[asyncio.Task] = []
        self._queue: asyncio.Queue[tuple[int, CompletionEvent]] = asyncio.Queue()  # (request index, event)
        self._last_event_time: list[float | None] = [None] * len(states)
        self._first_token_time: list[float | None] = [None] * len(states)
        self._queue_time: list[float] = [0.0] * len(requests)  # as each request's worker reported it
        self.request_id = request_id  # the client's id of the HTTP request (logs)
        self.worker_ids: list[str] = []  # every worker that served one of its requests (the request log line)
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
        refused = [e for e in results if e.refused]
        if refused:  # a request no worker could ever serve: the client's to fix, so a 400 before any output
            raise bad_request(refused[0].error)
        self._firsts = results

    @staticmethod
    async def _first_event(gen) -> CompletionEvent:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return CompletionEvent(error="worker stream ended before the first token")

    def _choices_of(self, r: int) -> list[ChoiceState]:
        n = self.num_choices_per_prompt
        return self.states[r * n : (r + 1) * n]

    async def deltas(self) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """(choice index, delta) until every choice is finished; raises GenerationFailed on a worker error."""
        n = self.num_choices_per_prompt
        self._pumps = [
            asyncio.create_task(self._pump(r, g, f)) for r, (g, f) in enumerate(zip(self._gens, self._firsts))
        ]
        while not all(s.is_finished for s in self.states):
            r, event = await self._next_event()
            if event.error is not None:
                raise GenerationFailed(event.error)
            if not 0 <= event.index < n:
                raise GenerationFailed(f"worker sent completion index {event.index}; the request has n = {n}")
            i = r * n + event.index
            if self.states[i].is_finished:  # ended here by a stop string; the worker had not heard yet
                continue
            self._check_prompt_logprobs(r, self.states[i], event)
            self._observe_latency(i, r, event)
            delta = self.states[i].feed(event)
            if delta.stopped_by_string and all(s.is_finished for s in self._choices_of(r)):
                self._pumps[r].cancel()
                await self._backend.abort(self._requests[r].request_id)
            yield i, delta

    def _check_prompt_logprobs(self, r: int, state: ChoiceState, event: CompletionEvent) -> None:
        """Asked-for prompt logprobs come on a completion's first event, one per prompt token after the
        first: the responses index them by prompt position."""
        if self._requests[r].sampling.prompt_logprobs is None or state.prompt_logprobs is not None:
            return
        prompt = self._requests[r].prompt_token_ids
        got = event.prompt_logprobs
        if got is None or [e.token_id for e in got] != prompt[1:]:
            what = "no" if got is None else f"{len(got)} (not matching the prompt's tokens)"
            raise GenerationFailed(f"worker sent {what} prompt logprobs for a prompt of {len(prompt)} tokens")

    async def _next_event(self) -> tuple[int, CompletionEvent]:
        deadline = self._requests[0].deadline  # one HTTP request: every choice shares the deadline
        try:
            return await get_by(self._queue, deadline)
        except TimeoutError:
            waited = deadline - self._requests[0].arrival_time
            raise GenerationFailed(f"request timed out after {waited:.1f} s") from None

    async def _pump(self, r: int, gen, event: CompletionEvent) -> None:
        running = set(range(self.num_choices_per_prompt))  # completions without a finish reason yet
        try:
            while True:
                await self._queue.put((r, event))
                if event.error is not None:
                    return
                if event.finish_reason is not None:
                    running.discard(event.index)
                    if not running:
                        return
                event = await gen.__anext__()
        except StopAsyncIteration:
            await self._queue.put((r, CompletionEvent(error="worker stream ended without a finish reason")))
        except Exception as e:  # a broken backend must surface as a clean error, not a hung request
            await self._queue.put((r, CompletionEvent(error=f"{type(e).__name__}: {e}")))
        finally:
            await gen.aclose()

    def _observe_latency(self, i: int, r: int, event: CompletionEvent) -> None:
        now = time.monotonic()
        last = self._last_event_time[i]
        if event.queue_time_s is not None:
            self._metrics.request_queue_time.observe(event.queue_time_s)
            self._queue_time[r] = event.queue_time_s
        for worker_id in event.worker_ids or ():
            if worker_id not in self.worker_ids:
                self.worker_ids.append(worker_id)
        if event.token_ids:
            if last is None:
                self._first_token_time[i] = now
                self._metrics.time_to_first_token.observe(now - self._requests[r].arrival_time)
            else:
                self._metrics.inter_token_latency.observe(now - last)
            self._last_event_time[i] = now

    @property
    def trace(self):
        """The HTTP request's trace (every backend request carries the same); None when not traced."""
        return self._requests[0].trace

    def timings(self) -> list[ChoiceTiming]:
        """Each choice's timestamps and outcome so far (the request metrics and log line read them)."""
        n = self.num_choices_per_prompt
        return [
            ChoiceTiming(
                self._queue_time[i // n],
                self._first_token_time[i],
                self._last_event_time[i],
                s.num_output_tokens,
                s.finish_reason,
            )
            for i, s in enumerate(self.states)
        ]

    async def abort(self) -> None:
        """Abort every backend request (the client left before the first token): the workers let go
        at once, and ``start`` returns with each request ended."""
        for request in self._requests:
            await self._backend.abort(request.request_id)

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
            for r, request in enumerate(self._requests):
                if not all(s.is_finished for s in self._choices_of(r)):
                    await self._backend.abort(request.request_id)
        return True
