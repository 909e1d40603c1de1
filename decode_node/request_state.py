"""One request on the decode worker: its sequence, its phase, and what has been streamed of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sched.sequence import Sequence
from telemetry.tracing import RequestTrace


class Phase(enum.IntEnum):
    COMPILING = -1  # its structured output's grammar compiles on the grammar thread; nothing held yet
    AWAITING_KV = 0  # blocks reserved here, PrefillJob out: the prefill worker is writing the prompt's KV
    SCHEDULED = 1  # in the engine scheduler: waiting, prefilling locally, or decoding


@dataclass(slots=True, eq=False)
class DecodeRequest:
    rid: str
    seq: Sequence  # the caller's sequence (completion 0); n > 1 forks the others in the scheduler
    deadline: float  # time.time(): past it the request is dropped and its blocks freed
    arrived: float  # time.monotonic() at Generate
    phase: Phase
    prefill_address: str = ""  # the prefill worker doing its job ("" once it is done or never)
    generation: int = 0  # transfer generation of the current attempt
    num_sent: list[int] = field(default_factory=list)  # per completion: output tokens already streamed
    done: list[bool] = field(default_factory=list)  # per completion: finished (event sent)
    announced: list[bool] = field(default_factory=list)  # per completion: this node sent it an event
    last_token_at: float = 0.0  # time.monotonic() of the last token streamed (inter-token latency)
    trace: RequestTrace | None = None  # its span here when the gateway traces it (telemetry/tracing.py)
    gateway_id: str = ""  # the gateway that sent it: its events go there, and its loss aborts it

    def __post_init__(self) -> None:
        n = self.seq.params.n
        self.num_sent = self.num_sent or [0] * n
        self.done = self.done or [False] * n
        self.announced = self.announced or [False] * n
        assert len(self.num_sent) == len(self.done) == n

    @property
    def wants_logprobs(self) -> bool:
        return self.seq.params.logprobs is not None

    @property
    def is_done(self) -> bool:
        return all(self.done)
