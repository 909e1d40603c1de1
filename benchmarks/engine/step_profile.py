"""Where a decode step's time goes: the offline engine decoding B sequences of 256-token prompts.

    python -m benchmarks.engine.step_profile [--batch 1 16 32] [--steps 40] [--repeats 3] [--threads N] [--model DIR]

For each batch size: the prompts are prefilled first (not measured), then ``--steps`` decode steps are
timed ``--repeats`` times and the fastest run is reported. Each share is the time spent inside one kind
of work, measured by wrapping the functions that do it (``perf_counter`` on entry and exit, exclusive of
nested kinds, so the shares add up to the step):

    fused layers    every decoder layer of a decode step as one C call (engine/model/decode_step.py), where
                    the step takes it: its linears, attention and layer ops are then inside this one
    layer linears   every projection of every layer (engine/model/cpu_linear.py: C, oneDNN or torch forms)
    LM head         the final norm and the vocab projection of the sampled rows
    attention       paged attention (the C decode kernel, or the torch path for prefill rows)
    layer ops       RMSNorm with its residual add, RoPE with the K/V store, SwiGLU's product (C)
    model glue      the rest of the forward: embedding, RoPE tables, views, Python between the kernels
    step inputs     the runner's inputs and attention metadata (engine/step/runner.py ``_prepare``)
    sampler         the sampler on the step's logits
    scheduler       scheduling the batch and appending the sampled tokens
    engine other    the rest of ``LLMEngine.step``

Then the torch operators run per decode step (torch.profiler; the C kernels are not torch operators):
a count that timing noise does not move. On a shared machine read the shares, not the milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time

import torch

CATEGORIES = (
    "fused layers",
    "layer linears",
    "LM head",
    "attention",
    "layer ops",
    "model glue",
    "step inputs",
    "sampler",
    "scheduler",
    "engine other",
)
PROMPT_TOKENS = 256


class ExclusiveTimer:
    """Seconds per category, each counting only the time not spent in a category entered inside it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._stack: list[str] = []
        self._since = 0.0  # when the innermost open category last resumed

    def enter(self, category: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
        self._stack.append(category)
        self._since = now

    def leave(self) -> None:
        now = time.perf_counter()
        self.seconds[self._stack.pop()] += now - self._since
        self._since = now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)


def _timed(timer: ExclusiveTimer, category: str, fn):
    def wrapper(*args, **kwargs):
        timer.enter(category)
        try:
            return fn(*args, **kwargs)
        finally:
            timer.leave()

    return wrapper


@contextlib.contextmanager
def instrumented(timer: ExclusiveTimer):
    """Wraps the functions of each category (class attributes, restored on exit)."""
    import kernels
    from engine.llm_engine import LLMEngine
    from engine.model.cpu_linear import Linear
    from engine.model.decode_step import FusedDecodeStep
    from engine.model.model import CausalLM
    from engine.sampling.sampler import Sampler
    from engine.sched.scheduler import Scheduler
    from engine.step.runner import ModelRunner
    from kernels.cpu.native import NativeLibrary

    targets = [
        (FusedDecodeStep, "run", "fused layers"),
        (Linear, "forward", "layer linears"),
        (CausalLM, "compute_logits", "LM head"),
        (kernels, "paged_attention", "attention"),
        (NativeLibrary, "rms_norm", "layer ops"),
        (NativeLibrary, "rope_store", "layer ops"),
        (NativeLibrary, "silu_mul", "layer ops"),
        (CausalLM, "forward", "model glue"),
        (ModelRunner, "_prepare", "step inputs"),
        (Sampler, "__call__", "sampler"),
        (Scheduler, "schedule", "scheduler"),
        (Scheduler, "postprocess", "scheduler"),
        (LLMEngine, "step", "engine other"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, category in targets:
            setattr(owner, name, _timed(timer, category, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def decoding_engine(llm, batch: int, max_tokens: int, seed: int = 0):
    """``llm``'s engine with ``batch`` greedy requests prefilled and decoding."""
    from engine.sampling.params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # warm-up decode steps
        engine.step()
    return engine


def torch_ops_per_step(engine, steps: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))) / steps


def profile_batch(llm, batch: int, steps: int, repeats: int) -> tuple[float, dict[str, float], float]:
    """(fastest ms per step, share of each category in that run, torch ops per step)."""
    engine = decoding_engine(llm, batch, max_tokens=(steps + 1) * (repeats + 1) + 8)
    timer = ExclusiveTimer()
    best: tuple[float, dict[str, float]] | None = None
    with instrumented(timer):
        for _ in range(repeats):
            timer.reset()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - start
            if best is None or wall < best[0]:
                best = (wall, dict(timer.seconds))
    ops = torch_ops_per_step(engine, min(steps, 10))
    for seq in list(engine.scheduler.running):
        engine.abort(engine.scheduler.request_id_of(seq))
    while engine.has_unfinished():
        engine.step()
    wall, seconds = best
    return wall / steps * 1e3, {k: v / wall for k, v in seconds.items()}, ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    args = p.parse_args(argv)

    from benchmarks.engine.throughput import resolve_model_dir
    from engine.llm import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(str(resolve_model_dir(args.model)), device="cpu", num_threads=args.threads)
    print(f"decode steps of {PROMPT_TOKENS}-token prompts, {args.threads} threads, fastest of {args.repeats} "
          f"runs of {args.steps} steps; share of the step in each kind of work")  # fmt: skip
    print(f"{'batch':>5} {'ms/step':>8} " + " ".join(f"{c:>13}" for c in CATEGORIES) + f" {'torch ops':>9}")
    for batch in args.batch:
        ms, shares, ops = profile_batch(llm, batch, args.steps, args.repeats)
        cells = " ".join(f"{shares[c] * 100:>12.1f}%" for c in CATEGORIES)
        print(f"{batch:>5} {ms:>8.2f} {cells} {ops:>9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
