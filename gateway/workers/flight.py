"""One request in flight at the gateway: the workers serving it, the records they sent back for it, and
those records turned into what the serving pipeline reads (``CompletionEvent``, ``TokenLogprob``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from protocol.serving import TokenEvent, TokenLogprobRecord

from .backend import CompletionEvent, TokenLogprob


@dataclass(slots=True)
class WorkerGone:
    """Queued to a request when a worker serving it left (expired, restarted, goodbye, unreachable)."""

    worker_id: str
    reason: str


class Flight:
    """One request in flight: which workers serve it, and the records that came back for it."""

    __slots__ = (
        "rid",
        "wire_rid",
        "num_attempts",
        "num_prompt_tokens",
        "num_top_prompt_logprobs",
        "events",
        "prompt_logprobs",
        "decode_worker",
        "prefill_worker",
        "is_done",
        "is_aborted",
    )

    def __init__(self, rid: str, num_prompt_tokens: int, num_top_prompt_logprobs: int = 0) -> None:
        self.rid = rid
        # What the workers of the current attempt know it by: the request id, then "<rid>~<attempt>" on a
        # retry, so that an abort or a late frame of an earlier attempt cannot touch a later one (a retry
        # on the same prefill worker would otherwise be aborted by the gateway's abort of the first try).
        self.wire_rid = rid
        self.num_attempts = 0
        self.num_prompt_tokens = num_prompt_tokens
        # the k asked for: alternatives past it are dropped on arrival, so a worker cannot grow what is kept
        self.num_top_prompt_logprobs = num_top_prompt_logprobs
        self.events: asyncio.Queue = asyncio.Queue()  # TokenEvent | Busy | WorkerGone | None (aborted)
        # From PromptLogprobs frames, which precede the first TokenEvent; None once a frame was out of order.
        self.prompt_logprobs: list[TokenLogprob] | None = []
        self.decode_worker: str | None = None
        self.prefill_worker: str | None = None
        self.is_done = False  # finished, failed or aborted: the workers need no more abort
        self.is_aborted = False  # the HTTP layer gave up on it (client gone, stop string, shutdown)

    def workers(self) -> list[str]:
        return [w for w in (self.decode_worker, self.prefill_worker) if w is not None]


def to_logprob(r: TokenLogprobRecord, rank: int | None = None, max_top: int | None = None) -> TokenLogprob:
    return TokenLogprob(r.token_id, r.logprob, list(zip(r.top_ids[:max_top], r.top_logprobs[:max_top])), rank)


def to_backend_event(e: TokenEvent, queue_time_s: float | None) -> CompletionEvent:
    logprobs = None if e.logprobs is None else [to_logprob(r) for r in e.logprobs]
    return CompletionEvent(
        index=e.index,
        token_ids=list(e.token_ids),
        logprobs=logprobs,
        finish_reason=e.finish_reason or None,
        num_cached_tokens=e.num_cached_tokens if e.num_cached_tokens >= 0 else None,
        queue_time_s=queue_time_s,
    )


def describe(answer) -> str:
    """Why an attempt ended without tokens, for the error the client gets."""
    if isinstance(answer, WorkerGone):
        if answer.reason == "deadline":
            return "the request's deadline passed"
        return f"worker {answer.worker_id} {answer.reason}"
    if isinstance(answer, TokenEvent):
        return f"worker error: {answer.error[:200]}"
    return "aborted"
