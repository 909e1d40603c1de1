"""Offline engine throughput: pdserve vs transformers, on one seeded workload, in one process.

    python -m benchmarks.engine.throughput [--quick] [--model DIR] [--device cpu|cuda] [--dtype ...]

Systems: (1) transformers ``generate`` one request at a time, (2) transformers static batching
(batches of 16 in arrival order, left-padded, run to the batch's longest request; only requested
tokens count), (3) pdserve ``LLM.generate`` over the whole workload. All greedy, EOS ignored, on one
device in one dtype (default: CUDA bfloat16 where there is a GPU, else CPU float32; --device/--dtype
choose), the same torch thread count. Model loading is not timed; each system gets one short warm-up.

Reported per system: output tokens/s, output tokens per process CPU-second, wall time. Then, on CPU, the
compute roofline of the pdserve run (see benchmarks/engine/roofline.py) next to the highest fraction this
machine allows for these steps (the matmul floor, benchmarks/engine/matmul_floor.py), the targets, and a token-for-token
cross-check of pdserve's greedy output against transformers. On CPU the line before the last is

    roofline_vs_fastest_matmul=<fraction> (<FLOP or memory>-bound)

the roofline priced at the fastest matmul this machine runs at the benchmark's shapes (torch's kernels
and pdserve's own, every thread count: benchmarks/engine/fastest_matmul.py) and at its memory bandwidth,
whichever bound is larger (benchmarks/engine/roofline.py). The last line is

    vs_hf_static=<pdserve tok/s / static tok/s> roofline=<fraction, or n/a off CPU>
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.common.device_choice import BenchDevice, add_device_args, choose_device
from benchmarks.common.workload import BenchRequest, SystemResult, WorkloadSpec, make_workload, total_output_tokens
from benchmarks.engine import fastest_matmul, matmul_floor, roofline
from benchmarks.peers import hf_baseline

TARGET_VS_STATIC = 2.5
TARGET_ROOFLINE = 0.6
STATIC_BATCH_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="16 requests; one-at-a-time on 4 of them, extrapolated per token"
    )
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--num-requests", type=int, default=None, help="default 64 (also with --quick)")
    p.add_argument(
        "--one-at-a-time-requests",
        type=int,
        default=None,
        help="requests run one at a time (default all, or 2 with --quick); the rest is extrapolated",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for every system")
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to LLM(...) when given")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="passed to LLM(...) when given")
    add_device_args(p)
    return p.parse_args(argv)


def resolve_model_dir(model: str | None) -> Path:
    """``--model``, else the random-weight llama ``small`` made once and cached (what ``pdserve`` uses)."""
    from configs.model_source import default_model_dir

    return Path(model) if model is not None else default_model_dir()


def pdserve_config(bench: BenchDevice, engine_overrides: dict):
    """The config pdserve runs with: the benchmark's dtype, whatever the presets' "auto" would pick."""
    from configs.loader import load_config

    overrides = {"model.dtype": bench.dtype, **{f"engine.{k}": v for k, v in engine_overrides.items()}}
    return load_config(None, env={}, overrides=overrides)


def run_pdserve(
    model_dir: Path, requests: list[BenchRequest], bench: BenchDevice, engine_overrides: dict
) -> tuple[SystemResult, float]:
    """pdserve's offline ``LLM`` over the whole workload; returns the result and the load time."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    load_start = time.perf_counter()
    llm = LLM(str(model_dir), config=pdserve_config(bench, engine_overrides), device=bench.device)
    load_s = time.perf_counter() - load_start
    warmup = requests[0]
    llm.generate([list(warmup.prompt_token_ids[:16])], [_greedy(SamplingParams, 2)])

    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [_greedy(SamplingParams, r.output_len) for r in requests]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0

    outputs = {r.index: list(res.outputs[0].token_ids) for r, res in zip(requests, results)}
    # Tokens beyond the request (there should be none) are not output; a short one would show as a mismatch.
    produced = sum(min(len(outputs[r.index]), r.output_len) for r in requests)
    return SystemResult("pdserve", len(requests), produced, wall_s, cpu_s, outputs), load_s


def _greedy(sampling_params_cls, max_tokens: int):
    return sampling_params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_one_at_a_time(model, requests: list[BenchRequest], subset: int) -> SystemResult:
    """One-at-a-time on the first ``subset`` requests; the whole workload's time scaled per token."""
    measured = hf_baseline.run_one_at_a_time(model, requests[:subset])
    if subset >= len(requests):
        return measured
    scale = total_output_tokens(requests) / measured.output_tokens
    return SystemResult(
        measured.name,
        len(requests),
        total_output_tokens(requests),
        measured.wall_s * scale,
        measured.cpu_s * scale,
        measured.outputs,
        note=f"EXTRAPOLATED per token from {subset} requests ({measured.output_tokens} tokens, "
        f"{measured.wall_s:.1f} s)",
    )


def count_mismatches(reference: SystemResult, candidate: SystemResult) -> tuple[int, int, str]:
    """(requests compared, requests whose tokens differ, first difference described)."""
    common = sorted(set(reference.outputs) & set(candidate.outputs))
    bad = [i for i in common if reference.outputs[i] != candidate.outputs[i]]
    first = ""
    if bad:
        ref, got = reference.outputs[bad[0]], candidate.outputs[bad[0]]
        pos = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        first = f" (first: request {bad[0]} at token {pos} of {len(ref)}, lengths {len(ref)} vs {len(got)})"
    return len(common), len(bad), first


TABLE_HEADER = f"{'system':<22}{'reqs':>5}{'out tok':>9}{'wall s':>9}{'tok/s':>9}{'tok/CPU-s':>11}  note"


def print_row(r: SystemResult) -> None:
    print(
        f"{r.name:<22}{r.num_requests:>5}{r.output_tokens:>9}{r.wall_s:>9.2f}"
        f"{r.tokens_per_s:>9.1f}{r.tokens_per_cpu_s:>11.1f}  {r.note}",
        flush=True,
    )


def hf_warmup(model, requests: list[BenchRequest]) -> None:
    hf_baseline.generate_batch(model, [r.prompt_token_ids[: 16 - 8 * i] for i, r in enumerate(requests[:2])], 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_requests = args.num_requests or 64
    subset = min(args.one_at_a_time_requests or (2 if args.quick else num_requests), num_requests)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    try:
        bench = choose_device(args.device, args.dtype, torch.cuda.is_available())
    except ValueError as exc:
        raise SystemExit(f"python -m benchmarks.engine.throughput: {exc}") from None

    hf_model = hf_baseline.load_hf_model(model_dir, bench)
    shape = roofline.DecoderShape.from_hf_config(hf_model.config)
    spec = WorkloadSpec(vocab_size=shape.vocab_size, num_requests=num_requests, seed=args.seed)
    requests = make_workload(spec)
    num_params = sum(p.numel() for p in hf_model.parameters())
    print(
        f"model {model_dir} ({num_params / 1e6:.1f} M params); every system on {bench.describe()}; "
        f"torch threads = {torch.get_num_threads()} for every system (cpu_count {os.cpu_count()})"
    )
    print(
        f"workload: {num_requests} requests, seed {args.seed}, prompt U{list(spec.prompt_len_range)}, "
        f"output U{list(spec.output_len_range)}, ignore_eos, greedy; "
        f"{sum(r.prompt_len for r in requests)} prompt + {total_output_tokens(requests)} output tokens"
    )

    print(f"\n{TABLE_HEADER}", flush=True)
    hf_warmup(hf_model, requests)
    one = run_one_at_a_time(hf_model, requests, subset)
    print_row(one)
    static = hf_baseline.run_static_batching(hf_model, requests, STATIC_BATCH_SIZE)
    print_row(static)
    del hf_model

    llm_kwargs = {
        k: v
        for k, v in (("max_num_seqs", args.max_num_seqs), ("max_num_batched_tokens", args.max_num_batched_tokens))
        if v is not None
    }
    pd, load_s = run_pdserve(model_dir, requests, bench, llm_kwargs)
    print_row(pd)
    print(f"(model load not timed; pdserve LLM() took {load_s:.1f} s; each system had one short warm-up)")
    print_summary(shape, requests, one, static, pd, with_roofline=bench.device == "cpu")
    return 0


def print_summary(
    shape: roofline.DecoderShape,
    requests: list[BenchRequest],
    one: SystemResult,
    static: SystemResult,
    pd: SystemResult,
    with_roofline: bool = True,
) -> None:
    """Roofline (CPU only: it and the matmul floor time fp32 ``torch.mm`` on this CPU), speed-ups
    against the targets, the greedy cross-check, and the one-line result."""
    vs_static = pd.tokens_per_s / static.tokens_per_s
    fraction, vs_fastest = print_roofline(shape, requests, pd) if with_roofline else (None, None)
    print(
        f"pdserve vs hf one-at-a-time: {pd.tokens_per_s / one.tokens_per_s:.2f}x"
        + (" (one-at-a-time extrapolated)" if one.note else "")
    )
    print(
        f"pdserve vs hf static batching: {vs_static:.2f}x   (target >= {TARGET_VS_STATIC}x) "
        f"{'MET' if vs_static >= TARGET_VS_STATIC else 'NOT MET'}"
    )
    if fraction is not None:
        print(
            f"roofline fraction: {fraction:.2f}   (target >= {TARGET_ROOFLINE}) "
            f"{'MET' if fraction >= TARGET_ROOFLINE else 'NOT MET'}"
        )
    for ref in (one, static):
        compared, bad, first = count_mismatches(ref, pd)
        print(f"greedy cross-check vs {ref.name}: {bad} mismatched of {compared} requests{first}")
    if vs_fastest is not None:
        print(f"roofline_vs_fastest_matmul={vs_fastest.fraction(pd.wall_s):.2f} ({vs_fastest.bound}-bound)")
    print(f"vs_hf_static={vs_static:.2f} roofline={'n/a' if fraction is None else f'{fraction:.2f}'}")


def print_roofline(
    shape: roofline.DecoderShape, requests: list[BenchRequest], pd: SystemResult
) -> tuple[float, roofline.Roofline]:
    """The roofline at ``torch.mm``'s rate (the headline's definition), the matmul floor, and the
    roofline at the fastest matmul and the memory bandwidth (returned for its own line)."""
    lengths = [(r.prompt_len, r.output_len) for r in requests]
    required = roofline.workload_flops(shape, lengths)
    matmul_flops = roofline.measure_matmul_flops(shape)
    fraction = roofline.roofline_fraction(required, matmul_flops, pd.wall_s)
    floor = matmul_floor.matmul_floor(shape, lengths, required, matmul_flops)
    print()
    print(
        f"roofline: required {required / 1e9:.1f} GFLOP / measured fp32 mm {matmul_flops / 1e9:.1f} GFLOP/s "
        f"= {required / matmul_flops:.2f} s ideal; pdserve wall {pd.wall_s:.2f} s"
    )
    print(
        f"matmul floor: {floor.floor_s:.2f} s (the {floor.num_decode_steps} decode steps' projections take "
        f"{floor.decode_measured_s:.2f} s measured at their row counts against {floor.decode_ideal_s:.2f} s at "
        f"the peak), so no engine running these steps here exceeds roofline {floor.roofline_at_floor:.2f}; "
        f"pdserve's wall is {pd.wall_s / floor.floor_s:.2f}x the floor"
    )
    return fraction, print_fastest_roofline(shape, lengths, required, pd.wall_s)


def print_fastest_roofline(
    shape: roofline.DecoderShape, lengths: list[tuple[int, int]], required_flops: float, wall_s: float
) -> roofline.Roofline:
    """Times every kernel at every shape and thread count, prints the fastest per shape, and prices the
    workload at the peak FLOP/s and the memory bandwidth."""
    timings = fastest_matmul.time_kernels(
        fastest_matmul.benchmark_shapes(shape), fastest_matmul.thread_counts(os.cpu_count() or 1)
    )
    best = fastest_matmul.fastest(timings)
    top = fastest_matmul.peak(best)
    bandwidth = fastest_matmul.memory_bandwidth(roofline.weight_bytes(shape))
    print("fastest matmul per shape (kernel@threads GFLOP/s; kernels: plain, transposed, packed, c = pdserve's C):")
    by_rows: dict[int, list[fastest_matmul.KernelTiming]] = {}
    for s, t in best.items():
        by_rows.setdefault(s.rows, []).append(t)
    for rows, row_timings in by_rows.items():
        print(f"  {rows:>5} rows: " + " | ".join(f"{t.shape.name} {t.describe()}" for t in row_timings))
    line = roofline.Roofline(
        required_flops, top.flops_per_s, roofline.workload_bytes(shape, lengths), bandwidth.bytes_per_s
    )
    print(
        f"roofline at the fastest matmul: peak {top.flops_per_s / 1e9:.1f} GFLOP/s ({top.kernel} on "
        f"{top.threads} threads, {top.shape.name} at {top.shape.rows} rows) -> {line.flop_s:.2f} s; "
        f"{line.num_bytes / 1e9:.1f} GB required ({roofline.min_forward_passes(lengths)} passes over "
        f"{roofline.weight_bytes(shape) / 1e6:.0f} MB of weights, decode KV reads "
        f"{roofline.decode_kv_bytes(shape, lengths) / 1e9:.1f} GB) at {bandwidth.bytes_per_s / 1e9:.1f} GB/s "
        f"({bandwidth.how}) -> {line.bytes_s:.2f} s; ideal {line.ideal_s:.2f} s ({line.bound}-bound), "
        f"pdserve wall {wall_s:.2f} s"
    )
    return line


if __name__ == "__main__":
    raise SystemExit(main())
