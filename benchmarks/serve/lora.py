"""Served LoRA overhead: the same seeded requests served by ``pdserve serve`` (1 prefill + 1 decode
worker, prefix cache on) on the base model alone and with 4 adapters mixed evenly, in one run.

    python -m benchmarks.serve.lora [--quick] [--rounds N] [--model DIR] [--cpus 0,1] [--rank R] [--json FILE]

Two systems, both started first, on the same cores with the same engine settings (the one not being
measured sits idle):

- ``base``: no ``--enable-lora`` (the base model at its strongest: no LoRA hook in any projection);
- ``lora``: ``--enable-lora --max-loras 4 --max-lora-rank R`` with 4 random PEFT adapters of rank R on
  every projection (q/k/v/o/gate/up/down: the most work an adapter adds), all in device slots, so
  the number is the gathered LoRA product's cost, not paging.

Each round, each system gets the same mixed workload (``benchmarks.serve.workloads.mixed``, the serving
benchmark's; a fresh seed per round, so no round hits the cache an earlier one filled) all at once, as
``benchmarks.serve.run``'s served throughput; on ``lora`` request i names adapter ``a{i mod 4}`` as its
``model``. The ``lora`` system then serves the same requests once more on the base model
(``lora_server_base``: what enabling LoRA costs requests that use none); its prompts hit no cache
the adapters' run filled, since an adapter's blocks hash apart from the base's. Rounds alternate
which system goes first, so a machine whose load drifts (a shared one) weighs on both alike. Every
request's output length is checked against its ``usage``. A system's tok/s is its output tokens over
its wall time, summed over the rounds; its tok/CPU-s the same over the CPU-seconds its whole process
tree spent (``lora_served_vs_base_per_cpu_s``, a companion line that other load on a shared machine
moves less). The last line is

    lora_served_vs_base=<lora tok/s / base tok/s>   (the issue's target: >= 0.8 on CPU)

``benchmarks.engine.lora_throughput`` measures the same ratio offline, in one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common.client import Target, send_one
from benchmarks.common.launcher import ServedSystem
from benchmarks.common.metrics import Slo, Summary, summarize
from benchmarks.common.procs import cpu_delta, sample_tree
from benchmarks.common.workload import BenchRequest
from benchmarks.engine.lora_throughput import NUM_ADAPTERS, write_adapter
from benchmarks.serve import workloads
from benchmarks.serve.workloads import Scheduled

QUICK_REQUESTS, FULL_REQUESTS = 32, 64
QUICK_ROUNDS, FULL_ROUNDS = 2, 3


def sections(lora: dict | None) -> dict:
    """benchmarks.serve.run's disaggregated system (prefix cache on, pools sized so nothing preempts),
    with ``lora`` as its LoRA section. A worker is dropped only after 120 s without a heartbeat: on a
    shared machine run far past its cores a long prefill step held one past the default 15 s (11 of
    32 requests failed, 2026-11-26), which says nothing about either system's throughput."""
    out = {
        "model": {"max_model_len": 4096},
        "engine": {"enable_prefix_caching": True, "max_num_seqs": 64, "kv_cache_memory_mb": 1024},
        "gateway": {"worker_timeout_s": 120.0},
    }
    return out | ({"lora": lora} if lora else {})


async def all_at_once(url: str, models: list[str], requests: list[BenchRequest], tag: str):
    """Every request sent at once, request i naming ``models[i % len(models)]``; (timelines, wall s)."""
    targets = [Target(url, m) for m in models]
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        timelines = await asyncio.gather(
            *(send_one(client, targets[r.index % len(targets)], Scheduled(0.0, r, tag)) for r in requests)
        )
        return list(timelines), time.perf_counter() - start


def warm_up(url: str, models: list[str], vocab: int) -> None:
    """A short request per served model (first-use costs out of the measured runs)."""
    requests = [BenchRequest(i, tuple((7 * i + j) % vocab for j in range(24 + 8 * i)), 4) for i in range(len(models))]
    timelines, _ = asyncio.run(all_at_once(url, models, requests, "warmup"))
    if failed := [t.error for t in timelines if not t.ok]:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


def measure(system: ServedSystem, models: list[str], requests, label: str, round_: int, runs: list) -> Summary:
    before = sample_tree(system.proc.pid)
    timelines, wall = asyncio.run(all_at_once(system.url, models, requests, label))
    cpu_s = sum(p.cpu_s for p in cpu_delta(before, sample_tree(system.proc.pid)))  # the serve tree's, every process
    summary = summarize(timelines, wall, Slo(2.0, 0.1))
    errors = [t.error for t in timelines if not t.ok]
    print(
        f"{round_:<6}{label:<18}{summary.num_ok:>4}/{summary.num_requests:<4}{summary.output_tokens:>8}{wall:>9.2f}"
        f"{summary.output_tps:>10.1f}{summary.ttft['p50']:>10.3f}{summary.tpot['p50'] * 1000:>10.1f}"
        f"{cpu_s:>9.1f}{summary.output_tokens / cpu_s:>10.1f}",
        flush=True,
    )
    if errors:
        print(f"  {len(errors)} failed, first: {errors[0]}", flush=True)
    runs.append({"round": round_, "run": label, "ok": summary.num_ok, "requests": summary.num_requests,
                 "output_tokens": summary.output_tokens, "wall_s": wall, "output_tps": summary.output_tps,
                 "cpu_s": cpu_s,
                 "ttft_p50_s": summary.ttft["p50"], "tpot_p50_s": summary.tpot["p50"]})  # fmt: skip
    system.wait_idle()
    return summary


def total_per(runs: list[dict], label: str, denominator: str) -> float:
    """Output tokens of the ``label`` runs over their summed ``denominator`` ("wall_s", "cpu_s")."""
    mine = [r for r in runs if r["run"] == label]
    return sum(r["output_tokens"] for r in mine) / sum(r[denominator] for r in mine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve.lora", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, not {FULL_REQUESTS}")
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--cpus", default=None, help="CPU list for both systems, e.g. 0,1 (default: this process's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    p.add_argument("--rounds", type=int, default=None, help=f"default {QUICK_ROUNDS} (--quick), else {FULL_ROUNDS}")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    started = time.perf_counter()
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # the client shares the systems' cores, as benchmarks.serve's
    from benchmarks.common.workload import prompt_vocab
    from configs.model_source import default_model_dir
    from engine.model.config import HFModelConfig

    model_dir = Path(args.model) if args.model else default_model_dir()
    vocab = prompt_vocab(model_dir)
    num_requests = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else FULL_ROUNDS)
    print(
        f"pdserve served LoRA benchmark{' (--quick)' if args.quick else ''}: model {model_dir}, cpus {sorted(cpus)}, "
        f"{platform.processor() or platform.machine()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; {rounds} rounds of "
        f"{num_requests} mixed requests all at once; {NUM_ADAPTERS} adapters of rank {args.rank} on every projection"
    )
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-bench-lora-"))  # kept: each system's serve log
    config = HFModelConfig.from_hf_dir(model_dir)
    adapters = [f"a{i}" for i in range(NUM_ADAPTERS)]
    modules = [f"{name}={write_adapter(workdir / name, config, args.rank, i)}" for i, name in enumerate(adapters)]
    lora = {"enable_lora": True, "lora_modules": modules, "max_loras": NUM_ADAPTERS, "max_lora_rank": args.rank}
    systems: dict[str, ServedSystem] = {}
    runs: list[dict] = []
    try:
        for name, settings in (("base", None), ("lora", lora)):
            systems[name] = ServedSystem(name, model_dir, workdir, cpus, 1, 1, sections(settings))
        served = {"base": [systems["base"].model], "lora": adapters}
        for name, system in systems.items():
            warm_up(system.url, served[name], vocab)
            system.wait_idle()
        columns = ("ok", 9), ("tokens", 8), ("wall s", 9), ("tok/s", 10), ("ttft p50", 10), ("tpot ms", 10)
        columns += ("CPU-s", 9), ("tok/CPU-s", 10)
        print(f"\n{'round':<6}{'run':<18}" + "".join(f"{c:>{w}}" for c, w in columns))
        for round_ in range(rounds):
            requests = workloads.mixed(vocab, num_requests, args.seed + round_)
            for name in ("base", "lora") if round_ % 2 == 0 else ("lora", "base"):
                measure(systems[name], served[name], requests, name, round_, runs)
                if name == "lora":
                    measure(systems[name], served["base"], requests, "lora_server_base", round_, runs)
    finally:
        for system in systems.values():
            system.stop()
    labels = ("base", "lora", "lora_server_base")
    tps = {label: total_per(runs, label, "wall_s") for label in labels}
    per_cpu = {label: total_per(runs, label, "cpu_s") for label in labels}
    ratio, base_on_lora = tps["lora"] / tps["base"], tps["lora_server_base"] / tps["base"]
    complete = all(r["ok"] == r["requests"] for r in runs)
    print(f"\n{'over the rounds':<24}" + "".join(f"{label} {value:.1f} tok/s   " for label, value in tps.items()))
    print(f"{'':<24}" + "".join(f"{label} {value:.1f} tok/CPU-s   " for label, value in per_cpu.items()))
    print(f"(logs in {workdir}; total {time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"quick": args.quick, "model": str(model_dir), "cpus": sorted(cpus),
                                               "rank": args.rank, "rounds": rounds, "runs": runs, "tok_per_s": tps,
                                               "tok_per_cpu_s": per_cpu, "lora_served_vs_base": ratio,
                                               "lora_server_base_vs_base": base_on_lora}, indent=2))  # fmt: skip
    # Tokens per CPU-second of the serve tree: less moved by other load on a shared machine than wall time
    # (not immune: caches and SMT siblings are shared too). A companion line; the headline is the last.
    print(f"lora_served_vs_base_per_cpu_s={per_cpu['lora'] / per_cpu['base']:.3f}")
    print(f"lora_server_base_vs_base={base_on_lora:.3f}")
    print(f"lora_served_vs_base={ratio:.3f}{'' if complete else ' (some requests failed: not a valid figure)'}")
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
