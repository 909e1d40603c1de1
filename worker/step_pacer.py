"""How many tokens the next step of a decode worker that prefills its own prompts may compute, so
that a step ends within a heartbeat interval.

A step's length no longer decides whether the worker looks alive: heartbeats come from a thread of their
own (worker/liveness.py), and only a step past ``gateway.worker_step_timeout_s`` (300 s) counts as
wedged. It still decides how long everything else the loop does waits: aborts, new requests, and above
all the running sequences' next tokens, which a long prefill step holds back. A step of
``max_num_batched_tokens`` (2048) prompt tokens took 10-20 s on a 2-core EPYC shared with other jobs
(SmolLM2-135M, Q8_0 and f32 alike: ~105 prompt tokens/s there), and back then it also stopped the
heartbeats (issue #44's served run). So a smaller step, as vLLM's chunked prefill does with its token
budget, streams the running sequences' tokens between chunks of prompt.

The prefill worker is not paced: its steps hold no stream back (its jobs' only token is the first, sent
when the last chunk is computed); smaller steps there would take new jobs and aborts a little sooner,
at a cost in throughput, and are no longer needed to keep it registered.

So the budget is the configured one where the machine computes it within ``target_s``, else the
tokens the measured rate computes in ``target_s`` (never under ``floor``, which decodes take first).
The rate is an average over recent steps that used at least half their budget (a step of a few decode
rows measures per-step overhead, not the rate a full step runs at). Before any such step, the first
budget is one prefill chunk. Which tokens a step computes changes no result: chunked prefill is
token-exact at any chunk boundary (tests/test_engine_generate.py), only when each token comes.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.5  # weight of the newest step in the rate average: a loaded machine's rate moves fast


@dataclass(slots=True)
class StepPacer:
    configured: int  # max_num_batched_tokens as configured: the budget never exceeds it
    target_s: float  # a step should end within this (the heartbeat interval)
    first: int  # the budget before any rate is known (one prefill chunk)
    floor: int = 64  # the budget never goes under this (or ``configured``, if smaller)
    tokens_per_s: float = 0.0  # 0: not measured yet
    last_budget: int = 0

    def budget(self) -> int:
        if self.tokens_per_s <= 0:
            self.last_budget = min(self.configured, self.first)
        else:
            paced = int(self.tokens_per_s * self.target_s)
            self.last_budget = min(self.configured, max(self.floor, paced))
        return self.last_budget

    def record(self, tokens: int, seconds: float) -> None:
        """One step computed ``tokens`` in ``seconds`` under the budget last handed out."""
        if seconds <= 0 or tokens * 2 < self.last_budget:
            return
        rate = tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s <= 0 else (1 - SMOOTHING) * self.tokens_per_s + SMOOTHING * rate
