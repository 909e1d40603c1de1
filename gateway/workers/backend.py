"""The interface the HTTP layer calls to generate tokens; the ZeroMQ worker client implements it later.

The HTTP layer sends one ``GenerationRequest`` per prompt; its ``sampling.n`` completions come back on one
stream of ``CompletionEvent``s told apart by ``index`` (the worker forks them copy-on-write, so the prompt is
prefilled and its KV transferred once). The stream ends when every completion carried a finish reason,
or at the first error. Stop strings are the gateway's business: when every completion of a request is
over for the gateway, it stops reading and calls ``abort``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from protocol.serving import SamplingSpec
from telemetry.tracing import RequestTrace


class NoCapacity(Exception):
    """Raised by ``generate`` before the first event when no worker can take the request now."""

    def __init__(self, retry_after_s: int = 1, reason: str = "no worker can take this request now") -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(slots=True)
class GenerationRequest:
    request_id: str  # unique per prompt; the key for abort
    prompt_token_ids: list[int]
    sampling: SamplingSpec  # the wire record itself: what the workers need to sample
    arrival_time: float  # time.monotonic() when the HTTP request arrived
    deadline: float | None = None  # time.monotonic() after which workers drop the request
    trace: RequestTrace | None = None  # the HTTP request's trace (telemetry/tracing.py); None: not traced

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompt"


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # prompt logprobs: the token's rank under the model, 1 = most likely


@dataclass(slots=True)
class CompletionEvent:
    """New tokens of one completion; its last event has ``finish_reason`` or ``error`` set."""

    index: int = 0  # which completion of the request, 0 .. n-1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when logprobs were asked for
    finish_reason: str | None = None  # "stop" (EOS or a stop token id) or "length"
    num_cached_tokens: int | None = None  # prompt tokens not recomputed; sent with the first event
    queue_time_s: float | None = None  # time the request waited for a worker; sent with the first event
    error: str | None = None  # the request failed in a worker; no more events follow
    refused: bool = False  # with error: refused as invalid before any work (the client's fault: a 400)
    # Asked-for prompt logprobs, on each completion's first event: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
    worker_ids: list[str] | None = None  # the workers serving it (decode, then prefill); with the first event

    def __post_init__(self) -> None:
        assert self.finish_reason in (None, "stop", "length"), self.finish_reason
        assert self.logprobs is None or len(self.logprobs) == len(self.token_ids)


class Backend(abc.ABC):
    """What the gateway needs from the worker pools."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[CompletionEvent]:
        """An async generator of events; raises ``NoCapacity`` before the first one if nobody can take it.

        Events of one completion arrive in order; completions interleave."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop generating for ``request_id`` and free its KV; unknown or finished ids are ignored."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """At least one worker able to serve a request is registered."""

    def lora_adapters(self) -> dict[str, str] | None:
        """The cluster's LoRA adapters (name -> path) as its workers hold them, which every gateway
        serves; None: this backend has no workers to hold a list (the gateway's own list is the truth)."""
        return None

    async def change_lora_adapters(self, name: str, path: str | None) -> str:
        """Load adapter ``name`` from ``path`` (None: unload it) on every worker, now and on workers that
        join later; wait until each has applied the change. Returns "" or why ``name`` did not load on
        some worker. A backend without separate workers has nothing to tell: ""."""
        return ""

    @abc.abstractmethod
    def has_capacity(self) -> bool:
        """A new request would be admitted now (checked before tokenizing, to shed load cheaply)."""

    async def start(self) -> None:
        """Called once in the serving event loop before the first request (open sockets, start tasks)."""

    async def stop(self) -> None:
        """Called once at shutdown in the same loop; in-flight requests are aborted."""
