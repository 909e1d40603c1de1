"""How many tokens the next step of a decode worker that prefills its own prompts may compute, so
that a step ends within a heartbeat interval. (A prefill worker has the same loop; pacing it is not wired yet.)

The worker's loop sends its heartbeats between steps, and the gateway drops a worker silent for
``worker_timeout_s`` (15 s). A step of ``max_num_batched_tokens`` (2048) prompt tokens took 10-20 s on
a 2-core EPYC shared with other jobs (SmolLM2-135M, Q8_0 and f32 alike: ~105 prompt tokens/s there),
so 16 concurrent 700-token prompts arriving at once stopped the heartbeats and every request failed
(issue #44's served run). Raising the timeout would hide a worker that is really stuck; a smaller
step keeps the loop answering (heartbeats, aborts, new requests) and streams the running sequences'
tokens between chunks of prompt, as vLLM's chunked prefill does with its token budget.

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
