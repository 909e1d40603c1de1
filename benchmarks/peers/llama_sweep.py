"""llama-server's configurations on the streams workload, to serve it at its strongest fair setting in
``benchmarks.serve.run`` (serve_plan.LLAMA_CONFIG): threads 1 or all cores, ``--parallel`` = the number of
streams or 64 (what ``benchmarks.serve.run`` needs for its other workloads), flash attention off or on.

    python -m benchmarks.peers.llama_sweep [--model DIR] [--rounds 2] [--threads 1,2] [--parallel streams,64]
                                     [--flash-attn off,on] [--concurrencies 1,16,32]

Each configuration serves each concurrency from a freshly started server (so ``--parallel streams``
can match it), with the same client, prompts and token counts as ``benchmarks.serve.run``'s streams runs.
Prints one row per configuration and concurrency (output tokens/s, ITL p50, TTFT p99) and, per
concurrency, the configuration with the most output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
from pathlib import Path

from benchmarks.common.client import Target, run_closed_loop
from benchmarks.common.metrics import Slo, Summary, summarize
from benchmarks.peers import llama_build
from benchmarks.peers.llama_server import LlamaConfig, LlamaServer, check
from benchmarks.serve import workloads
from benchmarks.serve.plan import LLAMA_CONFIG, STREAM_CONCURRENCIES, STREAM_OUTPUT_LEN, STREAM_PROMPT_LEN


def measure(
    config: LlamaConfig, gguf: Path, cpus: set[int], requests, concurrency: int, vocab: int, log: Path
) -> Summary:
    from benchmarks.serve.run import warm_up

    server = LlamaServer(config, gguf, cpus, log)
    try:
        target = Target(server.url, server.model)
        warm_up(target, vocab)
        server.wait_idle()
        timelines, duration = asyncio.run(run_closed_loop(target, requests, concurrency, "streams"))
        return summarize(timelines, duration, Slo(float("inf"), float("inf")))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.llama_sweep", description=__doc__)
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream at each concurrency")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--parallel", default="streams,64", help="'streams' (= the concurrency) and/or numbers")
    p.add_argument("--flash-attn", default="off,on")
    p.add_argument("--concurrencies", default=",".join(map(str, STREAM_CONCURRENCIES)))
    args = p.parse_args(argv)
    from benchmarks.common.workload import prompt_vocab
    from benchmarks.engine.throughput import resolve_model_dir

    cpus = os.sched_getaffinity(0)
    model_dir = resolve_model_dir(args.model)
    vocab = prompt_vocab(model_dir)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-llama-sweep-"))
    problems = check(model_dir, cpus, logs)
    if problems:
        raise SystemExit(f"llama-server's greedy output differs from transformers: {problems}")
    gguf = llama_build.convert(model_dir)
    concurrencies = tuple(int(c) for c in args.concurrencies.split(","))
    spec = workloads.StreamsSpec(vocab, concurrencies, STREAM_PROMPT_LEN, STREAM_OUTPUT_LEN, args.rounds, 8)
    levels = workloads.streams(spec)
    flash = [{"off": False, "on": True}[x] for x in args.flash_attn.split(",")]
    grid = list(itertools.product(args.threads.split(","), args.parallel.split(","), flash))
    best: dict[int, tuple[float, str]] = {}
    print(f"{'configuration':<34}{'streams':>8}{'out tok/s':>10}{'ITL p50 ms':>11}{'TTFT p99 ms':>12}{'ok':>8}")
    for threads, parallel, flash_attn in grid:
        for concurrency, requests in levels:
            slots = concurrency if parallel == "streams" else int(parallel)
            config = LlamaConfig(int(threads), slots, flash_attn, LLAMA_CONFIG.ctx_per_slot)  # as served
            name = f"-t {threads} --parallel {parallel} fa {'on' if flash_attn else 'off'}"
            s = measure(config, gguf, cpus, requests, concurrency, vocab, logs / "llama.log")
            print(
                f"{name:<34}{concurrency:>8}{s.output_tps:>10.1f}{s.itl['p50'] * 1000:>11.1f}"
                f"{s.ttft['p99'] * 1000:>12.0f}{f'{s.num_ok}/{s.num_requests}':>8}",
                flush=True,
            )
            if s.num_ok == s.num_requests and s.output_tps > best.get(concurrency, (0.0, ""))[0]:
                best[concurrency] = (s.output_tps, name)
    for concurrency, (tps, name) in sorted(best.items()):
        print(f"best at {concurrency} streams: {name} ({tps:.1f} out tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
