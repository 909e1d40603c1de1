"""Seeded synthetic workloads: random prompt token ids and output lengths, the same on every run.

Shared by the engine benchmark and the serving benchmarks, so a workload is named by its spec alone
and two systems measured on the same spec see the same requests in the same order. Torch-free: the
generator is ``random.Random``, whose sequence for a given seed is fixed across platforms.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    vocab_size: int  # prompt token ids are drawn from [0, vocab_size)
    num_requests: int = 64
    prompt_len_range: tuple[int, int] = (64, 512)  # inclusive, uniform
    output_len_range: tuple[int, int] = (16, 256)  # inclusive, uniform; generated with ignore_eos
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.vocab_size >= 1 and self.num_requests >= 1, self
        for low, high in (self.prompt_len_range, self.output_len_range):
            assert 1 <= low <= high, self


@dataclass(slots=True, frozen=True)
class BenchRequest:
    index: int  # arrival order, 0-based
    prompt_token_ids: tuple[int, ...]
    output_len: int  # exactly this many tokens are generated (EOS does not stop it)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The requests of ``spec`` in arrival order; a pure function of the spec."""
    rng = random.Random(spec.seed)
    requests = []
    for index in range(spec.num_requests):
        # Draw the lengths before the ids so that a request's lengths do not depend on the vocab.
        prompt_len = rng.randint(*spec.prompt_len_range)
        output_len = rng.randint(*spec.output_len_range)
        prompt = tuple(rng.randrange(spec.vocab_size) for _ in range(prompt_len))
        requests.append(BenchRequest(index, prompt, output_len))
    return requests


def total_output_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.output_len for r in requests)


def total_prompt_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.prompt_len for r in requests)


@dataclass(slots=True)
class SystemResult:
    """One system's run over a workload: what it produced and what it cost."""

    name: str
    num_requests: int
    output_tokens: int  # requested tokens only: padding or overshoot of a batch is not counted
    wall_s: float
    cpu_s: float  # process CPU time (all threads) spent in the run
    outputs: dict[int, list[int]]  # request index -> generated token ids
    note: str = ""  # e.g. how a number was extrapolated

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s


def prompt_vocab(model_dir: Path) -> int:
    """Token ids the gateway accepts: its tokenizer's vocabulary (it may be smaller than the model's)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
