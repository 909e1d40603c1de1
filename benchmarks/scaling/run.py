"""Scaling curves: served output throughput, TTFT p50/p99 and ITL p50/p99 against concurrency and
against prompt length, for pdserve disaggregated and colocated, llama.cpp's llama-server and
transformers static batching, on the same cores in one run.

    python -m benchmarks.scaling [--quick] [--systems disagg,coloc,llama,hf] [--concurrencies 1,4,16,32,64]
                                 [--prompt-lens 128,512,1024,2048,4096] [--prompt-concurrency 4]
                                 [--json FILE] [--plot-dir DIR] [--rounds N] [--min-requests N] [--plan-only]

1. The levels (benchmarks/scaling/plan.py): closed loops of 256 prompt / 128 output tokens at each
   concurrency (serve.py's streams workload), then of 128 output tokens at each prompt length with
   ``--prompt-concurrency`` in flight (4 by default: scaling_plan.PROMPT_CONCURRENCY says why), fresh
   prompts per level; the estimated duration of this run and of the full one.
2. Each pdserve system (serve_plan's disagg: 1 prefill + 1 decode; coloc: ``--prefill 0``) is started
   once, pinned to the benchmark's cores, with a context long enough for the longest prompt, warmed up,
   and runs every level with the streaming client, waiting for idle between levels.
3. llama-server (greedy output checked against transformers first, as in benchmarks.serve) is started
   fresh per concurrency with ``--parallel N`` (serve.py's streams configuration), slots long enough
   for the longest request it gets; the prompt sweep's levels share the server of their concurrency.
4. transformers (``hf``) runs each level offline in this process as static batching with batch size
   = the concurrency, torch threads = the cores; its TTFT and ITL are derived from the batch's step
   times (scaling_report.HF_NOTE).
5. A markdown table of every point, the plots (``--plot-dir``: scaling_vs_concurrency.png,
   scaling_vs_prompt_len.png) and the JSON (``--json``). The header names the CPU, cores and date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.common.client import Target, run_closed_loop
from benchmarks.common.metrics import Slo, summarize
from benchmarks.scaling import plan
from benchmarks.scaling.report import HF, Point, machine_line, table, write_json

SYSTEMS = ("disagg", "coloc", "llama", HF)
NO_SLO = Slo(float("inf"), float("inf"))  # goodput is not among this benchmark's figures


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer requests per level (2 rounds, at least 8)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {','.join(SYSTEMS)}")
    p.add_argument("--concurrencies", default=",".join(map(str, plan.CONCURRENCIES)), help="'' skips the sweep")
    p.add_argument("--prompt-lens", default=",".join(map(str, plan.PROMPT_LENS)), help="'' skips the sweep")
    p.add_argument("--prompt-concurrency", type=int, default=plan.PROMPT_CONCURRENCY)
    p.add_argument("--rounds", type=int, default=None, help="requests per stream per level (default 4, quick 2)")
    p.add_argument("--min-requests", type=int, default=None, help="per level at least (default 16, quick 8)")
    p.add_argument("--json", default=None, help="write every point to this JSON file")
    p.add_argument("--plot-dir", default=None, help="write the two PNG plots here (needs matplotlib)")
    p.add_argument("--plan-only", action="store_true", help="print the levels and the estimated duration; run none")
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--cpus", default=None, help="CPU list for every system, e.g. 0,1 (default: this process's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sweep_of(args) -> plan.Sweep:
    from benchmarks.serve.plan import plan as serve_sizes

    sizes = serve_sizes(args.quick)  # the streams workload's rounds and minimum, per mode
    return plan.Sweep(
        _ints(args.concurrencies),
        _ints(args.prompt_lens),
        args.prompt_concurrency,
        args.rounds or sizes.stream_rounds,
        args.min_requests or sizes.stream_min_requests,
        args.seed,
    )


def _point(name: str, level: plan.Level, timelines, duration: float) -> Point:
    summary = summarize(timelines, duration, NO_SLO)
    point = Point(name, level.axis, level.concurrency, level.prompt_len, level.output_len, summary)
    print(
        f"  {name:<7}{level.axis}={level.x:<6} {summary.num_ok}/{summary.num_requests} ok, "
        f"{summary.output_tps:.1f} out tok/s, TTFT p50/p99 {summary.ttft['p50'] * 1e3:.0f}/"
        f"{summary.ttft['p99'] * 1e3:.0f} ms, ITL p50/p99 {summary.itl['p50'] * 1e3:.1f}/"
        f"{summary.itl['p99'] * 1e3:.1f} ms",
        flush=True,
    )
    return point


def measure(name: str, target: Target, levels: list[plan.Level], vocab: int, settle) -> list[Point]:
    """Warms ``target`` up, then runs each level's closed loop against it; ``settle`` waits until the
    server is idle (after the warm-up and after each level)."""
    from benchmarks.serve.run import warm_up

    warm_up(target, vocab)
    settle()
    points = []
    for level in levels:
        result = asyncio.run(run_closed_loop(target, list(level.requests), level.concurrency, level.axis))
        points.append(_point(name, level, *result))
        settle()
    return points


def measure_started(name: str, server, levels: list[plan.Level], vocab: int) -> list[Point]:
    """``measure`` on ``server`` (a ServedSystem or a LlamaServer, just started), which it then stops."""
    try:
        return measure(name, Target(server.url, server.model), levels, vocab, server.wait_idle)
    finally:
        server.stop()


def run_pdserve(name: str, model_dir: Path, cpus: set[int], levels: list[plan.Level], vocab: int, logs: Path):
    """serve_plan's system ``name`` (its engine settings), with a context that holds the longest request."""
    from benchmarks.common.launcher import ServedSystem
    from benchmarks.serve.plan import plan as serve_sizes
    from benchmarks.serve.plan import select

    [spec] = select(serve_sizes(False), [name]).systems
    context = max(spec.sections["model"]["max_model_len"], plan.longest_request(levels))
    [spec] = select(serve_sizes(False), [name], overrides=[f"model.max_model_len={context}"]).systems
    system = ServedSystem(name, model_dir, logs, cpus, spec.num_prefill, spec.num_decode, spec.sections)
    print(f"  ({name}: {system.threads}; log {system.log_path})", flush=True)
    return measure_started(name, system, levels, vocab)


def run_llama(model_dir: Path, cpus: set[int], levels: list[plan.Level], vocab: int, logs: Path) -> list[Point]:
    """llama-server, if its greedy output is transformers' (else no point of it): a server per
    concurrency with ``--parallel N`` and slots that hold the longest request of its levels."""
    from benchmarks.peers import llama_build
    from benchmarks.peers.llama_server import LlamaServer, check
    from benchmarks.serve.plan import LLAMA_CONFIG

    problems = check(model_dir, cpus, logs)
    if problems:
        print(f"  (llama: NOT RUN, greedy output differs from transformers: {'; '.join(problems)})", flush=True)
        return []
    gguf = llama_build.convert(model_dir)
    points = []
    for concurrency in sorted({level.concurrency for level in levels}):
        mine = [level for level in levels if level.concurrency == concurrency]
        slot = max(LLAMA_CONFIG.ctx_per_slot, plan.longest_request(mine))
        config = replace(LLAMA_CONFIG.resolved(len(cpus)), parallel=concurrency, ctx_per_slot=slot)
        server = LlamaServer(config, gguf, cpus, logs / f"llama-parallel{concurrency}.log")
        print(f"  (llama: llama-server {config.label}, {slot} tokens per slot; log {server.log_path})", flush=True)
        points += measure_started("llama", server, mine, vocab)
    order = {(level.axis, level.x): k for k, level in enumerate(levels)}
    return sorted(points, key=lambda p: order[(p.axis, p.x)])


def run_hf(model_dir: Path, cpus: set[int], levels: list[plan.Level]) -> list[Point]:
    """transformers in this process, each level as static batching with batch size = its concurrency."""
    from benchmarks.peers import hf_baseline
    from benchmarks.serve.run import load_hf_baseline

    model = load_hf_baseline(model_dir, len(cpus), [], list(levels[0].requests))
    points = []
    for level in levels:
        result = hf_baseline.timed_static_batching(model, list(level.requests), level.concurrency, level.axis)
        points.append(_point(HF, level, *result))
    return points


def run(name: str, model_dir: Path, cpus: set[int], levels: list[plan.Level], vocab: int, logs: Path) -> list[Point]:
    if name == HF:
        return run_hf(model_dir, cpus, levels)
    if name == "llama":
        return run_llama(model_dir, cpus, levels, vocab, logs)
    return run_pdserve(name, model_dir, cpus, levels, vocab, logs)


def describe(levels: list[plan.Level]) -> str:
    """One clause per sweep: its values and requests per level."""
    parts = []
    for axis, what in ((plan.CONCURRENCY, "concurrency"), (plan.PROMPT_LEN, "prompt length")):
        mine = [level for level in levels if level.axis == axis]
        if mine:
            fixed = f"{mine[0].prompt_len} prompt" if axis == plan.CONCURRENCY else f"{mine[0].concurrency} in flight"
            values = ", ".join(f"{level.x} ({len(level.requests)} requests)" for level in mine)
            parts.append(f"{what} {values}; {fixed} / {mine[0].output_len} output tokens")
    return "\n  ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    wrong = [x for x in systems if x not in SYSTEMS]
    if wrong or not systems:
        raise SystemExit(f"python -m benchmarks.scaling: unknown system(s) {wrong}; choose from {list(SYSTEMS)}")
    if args.plot_dir and importlib.util.find_spec("matplotlib") is None:  # fail now, not after the runs
        raise SystemExit("--plot-dir needs matplotlib: pip install -e '.[plots]'")
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # the client and transformers share the systems' cores
    from benchmarks.common.workload import prompt_vocab
    from benchmarks.serve.run import require_llama_server
    from configs.model_source import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    vocab = prompt_vocab(model_dir)
    sweep = sweep_of(args)
    levels = plan.levels(vocab, sweep)
    if not levels:
        raise SystemExit("python -m benchmarks.scaling: no level to run (--concurrencies and --prompt-lens empty)")
    if "llama" in systems:
        require_llama_server("python -m benchmarks.scaling", "disagg,coloc,hf")
    header = machine_header(sorted(cpus))
    print(f"pdserve scaling benchmark{' (--quick)' if args.quick else ''}: {header}; model {model_dir}")
    print(f"systems {', '.join(systems)}; levels:\n  {describe(levels)}")
    print_estimate(levels, systems, vocab)
    if args.plan_only:
        return 0
    logs = Path(tempfile.mkdtemp(prefix="pdserve-scaling-"))  # kept: each system's log
    points = []
    for name in systems:
        try:
            points += run(name, model_dir, cpus, levels, vocab, logs)
        except Exception as exc:  # a long run keeps the other systems' points; logs in ``logs``
            print(f"  ({name}: FAILED, no point of it: {type(exc).__name__}: {exc})", flush=True)
    print(f"\n{header}\n\n{table(points)}\n")
    meta = {"header": header, "quick": args.quick, "cpus": sorted(cpus), "model": str(model_dir), "systems": systems}
    write_outputs(points, args, {**meta, "sweep": asdict(sweep)})
    print(f"(total {time.perf_counter() - started:.0f} s)")
    return 0


def machine_header(cpus: list[int]) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    return machine_line(cpuinfo.read_text() if cpuinfo.is_file() else "", cpus, os.cpu_count(), when)


def print_estimate(levels: list[plan.Level], systems: list[str], vocab: int) -> None:
    full = plan.levels(vocab, sweep_of(parse_args([])))
    print(
        f"estimated duration: this run {plan.minutes(plan.estimate_s(levels, systems))}, the full run "
        f"(every system and level, no --quick) {plan.minutes(plan.estimate_s(full, list(SYSTEMS)))} "
        "(scaling_plan.estimate_s: rates of 2 quiet Xeon cores, a rough guide)",
        flush=True,
    )


def write_outputs(points: list[Point], args, meta: dict) -> None:
    """--json and --plot-dir (the plots titled with the header line)."""
    if args.json:
        write_json(points, Path(args.json), meta)
        print(f"json: {args.json}")
    if args.plot_dir:
        from benchmarks.scaling.plots import write_scaling_plots

        for path in write_scaling_plots(points, Path(args.plot_dir), meta["header"]):
            print(f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
