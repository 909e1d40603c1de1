"""What the gateway says about a request once it has ended: its log line and its span's attributes.

    rid=cmpl-3f0c finished: model=X outcome=success prompt_tokens=40 cached_tokens=0 output_tokens=6
        ttft=0.031s e2e=0.052s finish=length workers=decode-0,prefill-0

One line per request, whatever the outcome (success | aborted | failed | rejected), as an operator greps
for one id; ``finish`` lists each choice's reason ("-": it did not finish), ``workers`` who served it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.metrics import ChoiceTiming


@dataclass(slots=True)
class RequestReport:
    request_id: str
    model: str
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None  # arrival to the first token of any choice; None: no token came
    e2e_s: float
    finish_reasons: str
    workers: str

    @classmethod
    def of(
        cls,
        request_id: str,
        model: str,
        outcome: str,
        usage: dict,
        timings: list[ChoiceTiming],
        workers: list[str],
        arrival: float,
        now: float,
    ) -> RequestReport:
        firsts = [t.first_token_at for t in timings if t.first_token_at is not None]
        return cls(
            request_id,
            model,
            outcome,
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
            min(firsts) - arrival if firsts else None,
            now - arrival,
            ",".join(t.finish_reason or "-" for t in timings),
            ",".join(workers) or "-",
        )

    def log_line(self) -> str:
        ttft = f"{self.ttft_s:.3f}s" if self.ttft_s is not None else "-"
        return (
            f"rid={self.request_id} finished: model={self.model} outcome={self.outcome} "
            f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
            f"output_tokens={self.output_tokens} ttft={ttft} e2e={self.e2e_s:.3f}s finish={self.finish_reasons} "
            f"workers={self.workers}"
        )

    @property
    def error(self) -> str | None:
        """The span's error: a failed or refused request (a client leaving is not one)."""
        return None if self.outcome in ("success", "aborted") else self.outcome

    def span_attributes(self) -> dict:
        return {
            "gen_ai.usage.prompt_tokens": self.prompt_tokens,
            "gen_ai.usage.completion_tokens": self.output_tokens,
            "gen_ai.response.finish_reasons": self.finish_reasons,
            "pdserve.outcome": self.outcome,
            "pdserve.cached_tokens": self.cached_tokens,
            "pdserve.workers": self.workers,
        }
