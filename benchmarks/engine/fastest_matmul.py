"""The fastest matmul this machine runs at a decoder's shapes, and the rate it streams memory: what
``roofline_vs_fastest_matmul`` (benchmarks/engine/roofline.py) prices a workload at.

The original roofline prices every FLOP at a 512-row fp32 ``torch.mm``, one kernel at one thread count,
though pdserve's own kernels are sometimes faster. Here each projection of the model (qkv, o, gate_up,
down; the LM head at sampled rows only) is timed at the row counts the engine benchmark runs (decode
batches of 1-64 rows, prefill steps of one 512-token chunk up to the 2048-token step budget) in every
kernel this machine has for it:

    plain        F.linear(x, w)                      (MKL / oneDNN through torch)
    transposed   (w @ x^T)^T                         (engine/model/cpu_linear.py's second torch form)
    packed       oneDNN on a weight packed once       (pack_weight / linear_packed)
    c            pdserve's C linear on its own layout (kernels/cpu/linear.c)

at every thread count from 1 to the cores (powers of two and the count itself), best of ``repeats``
after a warm-up. Each shape keeps its fastest (kernel, threads); the peak is the highest FLOP/s over
all shapes. Timed one shape at a time, the weight stays warm in cache: a rate the machine achieves,
so a fair ceiling, if one no full step of the model reaches.

Memory: the best of a copy (bytes read + written) and a read-only sum over a buffer the size of the
model's weights, the traffic a decode step cannot avoid (every weight read once per forward pass).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.engine.roofline import DecoderShape
from engine.model.cpu_linear import best_seconds, linear_packed, linear_transposed, pack_weight
from kernels.cpu import native as cpu_native

KERNELS = ("plain", "transposed", "packed", "c")
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64)  # engine_throughput: 64 requests, max_num_seqs 64
PREFILL_ROWS = (512, 2048)  # one prefill_chunk_size chunk; a full max_num_batched_tokens step


@dataclass(slots=True, frozen=True)
class MatmulShape:
    """``[rows, d_in] x [d_in, d_out]``; ``name`` says which projection it is."""

    name: str
    rows: int
    d_in: int
    d_out: int

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.d_in * self.d_out


@dataclass(slots=True, frozen=True)
class KernelTiming:
    shape: MatmulShape
    kernel: str  # a KERNELS entry
    threads: int
    seconds: float

    def __post_init__(self) -> None:
        assert self.kernel in KERNELS and self.threads >= 1 and self.seconds > 0, self

    @property
    def flops_per_s(self) -> float:
        return self.shape.flops / self.seconds

    def describe(self) -> str:
        return f"{self.kernel}@{self.threads}t {self.flops_per_s / 1e9:.1f}"


def benchmark_shapes(
    shape: DecoderShape, decode_rows: Iterable[int] = DECODE_ROWS, prefill_rows: Iterable[int] = PREFILL_ROWS
) -> list[MatmulShape]:
    """The model's projections at every decode and prefill row count; the LM head at decode row counts
    only (a step samples at most one row per sequence, so never more rows than a decode batch)."""
    names = ("qkv", "o", "gate_up", "down")
    decode_rows, prefill_rows = tuple(decode_rows), tuple(prefill_rows)
    shapes = [
        MatmulShape(name, rows, d_in, d_out)
        for rows in decode_rows + prefill_rows
        for name, (d_in, d_out) in zip(names, shape.linear_shapes())
    ]
    shapes += [MatmulShape("lm_head", rows, shape.hidden_size, shape.vocab_size) for rows in decode_rows]
    return shapes


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    counts = {cores}
    n = 1
    while n < cores:
        counts.add(n)
        n *= 2
    return sorted(counts)


def fastest(timings: Iterable[KernelTiming]) -> dict[MatmulShape, KernelTiming]:
    """Per shape, the timing with the fewest seconds (the first of equals, in the order given)."""
    best: dict[MatmulShape, KernelTiming] = {}
    for t in timings:
        if t.shape not in best or t.seconds < best[t.shape].seconds:
            best[t.shape] = t
    return best


def peak(best: dict[MatmulShape, KernelTiming]) -> KernelTiming:
    """The shape and kernel with the highest FLOP/s: the rate the roofline prices every FLOP at."""
    return max(best.values(), key=lambda t: t.flops_per_s)


def time_kernels(shapes: list[MatmulShape], threads: list[int], repeats: int = 3) -> list[KernelTiming]:
    """Every kernel that takes each shape, at every thread count (torch's thread count is restored)."""
    native = cpu_native.load()
    gen = torch.Generator().manual_seed(0)
    saved = torch.get_num_threads()
    timings = []
    try:
        for (d_in, d_out), group in _by_weight(shapes).items():
            weight = torch.randn(d_out, d_in, generator=gen)  # [out, in], as nn.Linear holds it
            forms = _forms(weight, native)
            for s in group:
                x = torch.randn(s.rows, d_in, generator=gen)  # [rows, in]
                for kernel, run in forms.items():
                    for n in threads:
                        torch.set_num_threads(n)  # the C linear reads the same count
                        timings.append(KernelTiming(s, kernel, n, best_seconds(lambda: run(x), repeats)))
    finally:
        torch.set_num_threads(saved)
    return timings


def _by_weight(shapes: list[MatmulShape]) -> dict[tuple[int, int], list[MatmulShape]]:
    groups: dict[tuple[int, int], list[MatmulShape]] = {}
    for s in shapes:
        groups.setdefault((s.d_in, s.d_out), []).append(s)
    return groups


def _forms(weight: torch.Tensor, native) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The kernels this machine has for ``weight``, each reading the copy it takes (made once here)."""
    forms = {
        "plain": lambda x: F.linear(x, weight),
        "transposed": lambda x: linear_transposed(x, weight),
    }
    packed = pack_weight(weight)
    if packed is not None:
        forms["packed"] = lambda x: linear_packed(x, packed)
    if native is not None and native.takes_weight(weight):
        c_copy = native.pack_linear(weight)  # [out / NR, in, NR]
        forms["c"] = lambda x: native.linear(x, c_copy)
    return forms


@dataclass(slots=True, frozen=True)
class Bandwidth:
    bytes_per_s: float
    how: str  # "copy" or "read", at how many threads


def memory_bandwidth(num_bytes: int, repeats: int = 3) -> Bandwidth:
    """The best of a copy (read + written bytes) and a read-only sum over ``num_bytes`` of float32, at
    every thread count."""
    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not a copy cost
    saved = torch.get_num_threads()
    best = Bandwidth(0.0, "")
    try:
        for n in thread_counts(os.cpu_count() or 1):
            torch.set_num_threads(n)
            copy = 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), repeats)
            read = src.numel() * 4 / best_seconds(lambda: src.sum(), repeats)
            for rate, how in ((copy, "copy"), (read, "read")):
                if rate > best.bytes_per_s:
                    best = Bandwidth(rate, f"{how}@{n}t")
    finally:
        torch.set_num_threads(saved)
    return best
