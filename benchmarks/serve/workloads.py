"""The serving benchmark's seeded workloads and their arrival schedules.

The shapes, each a pure function of its spec (``random.Random(seed)``, the same on every platform):

- mixed: ``benchmarks.common.workload.make_workload`` (prompts U[64,512], outputs U[16,256]), so the served
  run and the transformers baseline see the very same requests.
- shared prefix: ``num_prefixes`` random prefixes of ``prefix_len`` tokens; request i uses prefix
  i % num_prefixes followed by its own random suffix (U[32,128]); short outputs, so TTFT is the story.
- streams: fixed-length requests (256 prompt, 128 output tokens) for closed loops at 1, 16 and 32
  concurrent streams, fresh prompts at each concurrency: the shape of llama-server's own comparisons.
- interference: a steady Poisson stream of short decode-heavy requests ("short") plus, at fixed
  times, bursts of long prompts ("long", 2048 tokens, few output tokens) that a colocated worker must
  prefill between its decode steps.

A schedule is a list of ``Scheduled(at_s, request, tag)`` sorted by ``at_s`` (seconds after the start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.common.workload import BenchRequest, WorkloadSpec, make_workload


@dataclass(slots=True, frozen=True)
class Scheduled:
    at_s: float  # send time, seconds after the run starts
    request: BenchRequest
    tag: str  # workload class, carried into the metrics


def poisson_offsets(num: int, rate_rps: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of ``rate_rps`` (exponential gaps), the first at a gap too;
    ``rate_rps = inf`` sends everything at 0."""
    assert rate_rps > 0, rate_rps
    if rate_rps == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    now, out = 0.0, []
    for _ in range(num):
        now += rng.expovariate(rate_rps)
        out.append(now)
    return out


def mixed(vocab_size: int, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    return make_workload(WorkloadSpec(vocab_size=vocab_size, num_requests=num_requests, seed=seed))


def paced_mixed(vocab_size: int, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """The mixed workload for the closed loop at the baseline's batch size, a fresh draw (seed + 1000,
    clear of the rate sweep's): it runs on the server that also gets ``mixed(seed)`` all at once, and
    either run replaying the other's prompts would hit the cache it filled."""
    return mixed(vocab_size, num_requests, seed + 1000)


def rate_sweep(
    vocab_size: int, num_requests: int, rates_rps: tuple[float, ...], seed: int = 0
) -> list[tuple[float, list[BenchRequest]]]:
    """The mixed workload once per rate, with fresh prompts each time: replayed prompts would hit the
    prefix cache the run before filled, and ``mixed(..., seed)`` itself is kept for the closed loop
    (the requests transformers gets), which must find nothing cached either."""
    return [(rate, mixed(vocab_size, num_requests, seed + 1 + k)) for k, rate in enumerate(rates_rps)]


def poisson_schedule(requests: list[BenchRequest], rate_rps: float, tag: str, seed: int = 0) -> list[Scheduled]:
    offsets = poisson_offsets(len(requests), rate_rps, seed + 1)
    return [Scheduled(at, r, tag) for at, r in zip(offsets, requests)]


@dataclass(slots=True, frozen=True)
class SharedPrefixSpec:
    vocab_size: int
    num_requests: int = 32
    num_prefixes: int = 4
    prefix_len: int = 384
    suffix_len_range: tuple[int, int] = (32, 128)  # inclusive, uniform
    output_len_range: tuple[int, int] = (16, 64)
    seed: int = 0


def shared_prefix(spec: SharedPrefixSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    prefixes = [tuple(rng.randrange(spec.vocab_size) for _ in range(spec.prefix_len)) for _ in range(spec.num_prefixes)]
    requests = []
    for index in range(spec.num_requests):
        suffix_len = rng.randint(*spec.suffix_len_range)
        output_len = rng.randint(*spec.output_len_range)
        suffix = tuple(rng.randrange(spec.vocab_size) for _ in range(suffix_len))
        requests.append(BenchRequest(index, prefixes[index % spec.num_prefixes] + suffix, output_len))
    return requests


@dataclass(slots=True, frozen=True)
class InterferenceSpec:
    vocab_size: int
    num_short: int = 48
    short_rate_rps: float = 2.0  # Poisson arrivals of the short requests
    short_prompt_range: tuple[int, int] = (32, 128)
    short_output_range: tuple[int, int] = (64, 128)  # decode-heavy
    num_bursts: int = 3
    burst_size: int = 2  # long prompts sent together in one burst
    long_prompt_len: int = 2048
    long_output_len: int = 8
    seed: int = 0


def interference(spec: InterferenceSpec) -> list[Scheduled]:
    """Short requests over [0, T) at ``short_rate_rps``; bursts at T*(k+0.5)/num_bursts, k = 0..bursts-1,
    so every burst lands while short requests are decoding."""
    rng = random.Random(spec.seed)
    shorts = []
    for index in range(spec.num_short):
        prompt_len = rng.randint(*spec.short_prompt_range)
        output_len = rng.randint(*spec.short_output_range)
        shorts.append(BenchRequest(index, tuple(rng.randrange(spec.vocab_size) for _ in range(prompt_len)), output_len))
    schedule = poisson_schedule(shorts, spec.short_rate_rps, "short", spec.seed)
    horizon = schedule[-1].at_s
    index = spec.num_short
    for k in range(spec.num_bursts):
        at = horizon * (k + 0.5) / spec.num_bursts
        for _ in range(spec.burst_size):
            prompt = tuple(rng.randrange(spec.vocab_size) for _ in range(spec.long_prompt_len))
            schedule.append(Scheduled(at, BenchRequest(index, prompt, spec.long_output_len), "long"))
            index += 1
    return sorted(schedule, key=lambda s: (s.at_s, s.request.index))


@dataclass(slots=True, frozen=True)
class StreamsSpec:
    vocab_size: int
    concurrencies: tuple[int, ...]  # a closed loop at each, in this order
    prompt_len: int
    output_len: int
    rounds: int  # requests per concurrency c: rounds * c, so each stream sends ``rounds`` requests ...
    min_requests: int  # ... but at least this many (one stream needs several for a TTFT tail)
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.concurrencies and min(self.concurrencies) >= 1 and self.rounds >= 1, self


def streams(spec: StreamsSpec) -> list[tuple[int, list[BenchRequest]]]:
    """(concurrency, its requests) per level. Each level draws fresh prompts (seed + 2000 + k, clear of
    the mixed workload's seeds): a replayed prompt would hit the prefix cache the level before filled."""
    levels = []
    for k, concurrency in enumerate(spec.concurrencies):
        rng = random.Random(spec.seed + 2000 + k)
        count = max(spec.rounds * concurrency, spec.min_requests)
        requests = [
            BenchRequest(i, tuple(rng.randrange(spec.vocab_size) for _ in range(spec.prompt_len)), spec.output_len)
            for i in range(count)
        ]
        levels.append((concurrency, requests))
    return levels


def spec_levels(
    kind: str, concurrencies: tuple[int, ...], rounds: int, min_requests: int, output_len: int
) -> list[tuple[int, list[BenchRequest]]]:
    """(concurrency, its requests) per level of the speculative decoding workload ``kind`` ("spec_copy"
    or "spec_free", benchmarks/engine/spec_workloads.py): chat prompts of the real SmolLM2 tokenizer.
    Each level takes the next prompts of the fixed list, so no level replays another's (a replayed
    prompt would be a prefix cache hit)."""
    from transformers import AutoTokenizer

    from benchmarks.engine.spec_workloads import chat_prompts, smollm2_checkpoint

    counts = [max(rounds * c, min_requests) for c in concurrencies]
    texts = chat_prompts(kind, sum(counts))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    levels, start = [], 0
    for concurrency, count in zip(concurrencies, counts):
        requests = []
        for i, text in enumerate(texts[start : start + count]):
            messages = [{"role": "user", "content": text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            requests.append(BenchRequest(i, tuple(ids), output_len))
        levels.append((concurrency, requests))
        start += count
    return levels
