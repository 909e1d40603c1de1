"""Serving metrics from streamed-response timelines, with vLLM's definitions (benchmark_serving).

One request's timeline is what the client saw: when it sent the request, when each streamed chunk
carrying tokens arrived, and how many output tokens the server reported in ``usage``. From it:

- TTFT  = first token chunk - send
- e2e   = last token chunk - send
- TPOT  = (e2e - TTFT) / (output_tokens - 1)   (undefined for one-token outputs: left out)
- ITL   = the gaps between consecutive token chunks (a chunk may carry several tokens)

Aggregates: percentiles (linear interpolation, numpy's default), output throughput = output tokens
of all successful requests / the run's wall time, goodput = the share (and rate) of requests within a
TTFT and a TPOT SLO. Torch-free and numpy-free: plain floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestTimeline:
    index: int  # workload index of the request
    tag: str  # workload class: "mixed", "short", "long", "prefix", ...
    prompt_len: int
    expected_output_len: int  # what was asked for (ignore_eos: exactly this many)
    send_s: float  # client clock (time.perf_counter) when the request was sent
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens, in order
    output_tokens: int = 0  # from the usage chunk (0 until it arrives)
    error: str = ""  # non-empty: the request failed; it counts in no latency
    text: str = ""  # the streamed text, concatenated (checked against a reference by the soak test)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_s)

    @property
    def ttft(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2e(self) -> float:
        return self.chunk_s[-1] - self.send_s

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics; nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class Summary:
    num_requests: int
    num_ok: int
    duration_s: float
    output_tokens: int
    ttft: dict[str, float]  # "p50", "p90", "p99", "mean" -> seconds
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    goodput_share: float  # of all requests (a failed one is not good)
    goodput_rps: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def is_good(t: RequestTimeline, slo: Slo) -> bool:
    """Within both SLOs; a one-token output has no TPOT and is judged on TTFT alone (as vLLM does)."""
    if not t.ok or t.ttft > slo.ttft_s:
        return False
    tpot = t.tpot
    return tpot is None or tpot <= slo.tpot_s


def summarize(timelines: list[RequestTimeline], duration_s: float, slo: Slo) -> Summary:
    ok = [t for t in timelines if t.ok]
    good = sum(is_good(t, slo) for t in timelines)
    return Summary(
        num_requests=len(timelines),
        num_ok=len(ok),
        duration_s=duration_s,
        output_tokens=sum(t.output_tokens for t in ok),
        ttft=_stats([t.ttft for t in ok]),
        tpot=_stats([t.tpot for t in ok if t.tpot is not None]),
        itl=_stats([gap for t in ok for gap in t.itls]),
        e2e=_stats([t.e2e for t in ok]),
        goodput_share=good / len(timelines) if timelines else math.nan,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
    )


def kv_utilization(samples: list[tuple[int, int]]) -> float:
    """Live tokens / allocated block slots over (live_tokens, allocated_slots) samples: a ratio of sums,
    so idle moments (0, 0) weigh nothing and busy ones weigh by their size."""
    allocated = sum(a for _, a in samples)
    return sum(live for live, _ in samples) / allocated if allocated else math.nan
