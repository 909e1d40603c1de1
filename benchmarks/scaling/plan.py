"""What the scaling benchmark runs: the levels of its two sweeps, each a closed loop of fixed-length
requests with prompts of its own, and a rough estimate of how long they take.

- concurrency: the streams workload's requests (benchmarks/serve/workloads.py: 256 prompt / 128 output
  tokens, fresh prompts per level) at 1, 4, 16, 32 and 64 in flight;
- prompt length: 128 to 4096 prompt tokens, 128 output tokens, at PROMPT_CONCURRENCY in flight.

Each level sends ``rounds * concurrency`` requests, at least ``min_requests`` (serve_plan's streams
sizes: 4 and 16, ``--quick`` 2 and 8). Every level draws from a seed of its own, so no prompt shares a
block with one sent before on the same server and the prefix cache helps none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.common.workload import BenchRequest
from benchmarks.serve import workloads
from benchmarks.serve.plan import STREAM_OUTPUT_LEN, STREAM_PROMPT_LEN

CONCURRENCIES = (1, 4, 16, 32, 64)
PROMPT_LENS = (128, 512, 1024, 2048, 4096)
# The prompt sweep's streams: 4 keeps a batch to decode beside each prefill (the colocated worker's
# ITL shows every long prefill it interleaves, the disaggregated one's should not), while its 16
# requests per level (4 rounds) send 16 x 4096 = 65k prompt tokens at the longest, a few minutes per
# system on 2 cores; at 16 streams the same 4 rounds would send 4x that for the same curve.
PROMPT_CONCURRENCY = 4
SEED_STRIDE = 100  # the prompt sweep's level k draws from seed + (k + 1) * 100, clear of the concurrency
# sweep's seed + 0..len(concurrencies) - 1 (serve_workloads.streams adds 2000 to both)
CONCURRENCY = "concurrency"
PROMPT_LEN = "prompt_len"


@dataclass(slots=True, frozen=True)
class Level:
    axis: str  # CONCURRENCY or PROMPT_LEN: which sweep it is a point of
    concurrency: int  # requests in flight (transformers: its static batch size)
    prompt_len: int
    output_len: int
    requests: tuple[BenchRequest, ...]

    def __post_init__(self) -> None:
        assert self.axis in (CONCURRENCY, PROMPT_LEN) and self.requests, self.axis
        assert all(r.prompt_len == self.prompt_len and r.output_len == self.output_len for r in self.requests)

    @property
    def x(self) -> int:
        """Its value on its sweep's axis."""
        return self.concurrency if self.axis == CONCURRENCY else self.prompt_len


@dataclass(slots=True, frozen=True)
class Sweep:
    concurrencies: tuple[int, ...]  # empty: no concurrency sweep
    prompt_lens: tuple[int, ...]  # empty: no prompt-length sweep
    prompt_concurrency: int
    rounds: int
    min_requests: int
    seed: int = 0


def levels(vocab: int, sweep: Sweep) -> list[Level]:
    """The concurrency sweep's levels (ascending as given), then the prompt-length sweep's."""
    out = []
    if sweep.concurrencies:
        spec = workloads.StreamsSpec(
            vocab,
            sweep.concurrencies,
            STREAM_PROMPT_LEN,
            STREAM_OUTPUT_LEN,
            sweep.rounds,
            sweep.min_requests,
            sweep.seed,
        )
        for c, requests in workloads.streams(spec):
            out.append(Level(CONCURRENCY, c, STREAM_PROMPT_LEN, STREAM_OUTPUT_LEN, tuple(requests)))
    for k, prompt_len in enumerate(sweep.prompt_lens):
        spec = workloads.StreamsSpec(
            vocab,
            (sweep.prompt_concurrency,),
            prompt_len,
            STREAM_OUTPUT_LEN,
            sweep.rounds,
            sweep.min_requests,
            sweep.seed + (k + 1) * SEED_STRIDE,
        )
        [(c, requests)] = workloads.streams(spec)
        out.append(Level(PROMPT_LEN, c, prompt_len, STREAM_OUTPUT_LEN, tuple(requests)))
    return out


def longest_request(all_levels: list[Level]) -> int:
    """Prompt + output tokens of the longest request: what a context (or llama-server slot) must hold."""
    return max(level.prompt_len + level.output_len for level in all_levels)


# The estimate's assumptions, from the quiet 2-core Xeon's streams runs (docs/benchmarks.md, 2026-11-27)
# and this tool's first short runs (2026-11-27, 2 busy cores): one stream decodes ~ASSUMED_STREAM_TPS
# tokens/s, many together at most ~ASSUMED_PEAK_TPS; each decode step of a row costs
# ~ASSUMED_ATTENTION_S more per token of its context; prompts prefill at ~ASSUMED_PREFILL_TPS; each
# server start and warm-up (llama-server's greedy check, transformers' load) ~ASSUMED_START_S. Every
# system is priced alike; a busy machine slows the two-thread ones (llama-server, transformers) most.
ASSUMED_STREAM_TPS = 60.0
ASSUMED_PEAK_TPS = 450.0
ASSUMED_ATTENTION_S = 2.5e-6
ASSUMED_PREFILL_TPS = 1500.0
ASSUMED_START_S = 30.0


def estimate_s(all_levels: list[Level], systems: list[str]) -> float:
    """Seconds the run should take on 2 cores like the Xeon's (an estimate, not a measurement)."""
    per_system = 0.0
    for level in all_levels:
        n = len(level.requests)
        decode_tps = min(ASSUMED_STREAM_TPS * level.concurrency, ASSUMED_PEAK_TPS)
        context = level.prompt_len + level.output_len / 2  # a row's mean context while it decodes
        per_system += n * level.output_len * (1 / decode_tps + context * ASSUMED_ATTENTION_S)
        per_system += n * level.prompt_len / ASSUMED_PREFILL_TPS
    starts = sum(servers(name, all_levels) for name in systems)
    return per_system * len(systems) + starts * ASSUMED_START_S


def servers(system: str, all_levels: list[Level]) -> int:
    """How many times ``system`` is started: llama-server once per concurrency (``--parallel N``),
    the others once."""
    return len({level.concurrency for level in all_levels}) if system == "llama" else 1


def minutes(seconds: float) -> str:
    return f"~{math.ceil(seconds / 60)} min"
