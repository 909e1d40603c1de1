"""The serving benchmark's arithmetic and workload shapes, on synthetic timelines with known answers
(no cluster): vLLM's TTFT/TPOT/ITL/e2e, percentiles against numpy, goodput against hand-counted SLO
hits, KV utilisation, /proc parsing, and the seeded workloads' lengths, sharing and schedule."""

from __future__ import annotations

import math
import os
import random
import re

import numpy as np
import pytest

from benchmarks.common.client import parse_metric
from benchmarks.common.metrics import RequestTimeline, Slo, is_good, kv_utilization, percentile, summarize
from benchmarks.common.procs import CLOCK_TICKS, parse_stat, parse_vm_hwm_mb, sample_tree
from benchmarks.serve import plan as P
from benchmarks.serve import workloads as W


def timeline(index: int, send: float, chunks: list[float], tokens: int, tag: str = "mixed") -> RequestTimeline:
    return RequestTimeline(
        index, tag, prompt_len=10, expected_output_len=tokens, send_s=send, chunk_s=chunks, output_tokens=tokens
    )


def test_single_request_metrics_follow_vllm_definitions():
    # Sent at 10.0; chunks at 10.5, 10.6, 10.8, 11.1 carrying 5 tokens (one chunk held 2).
    t = timeline(0, 10.0, [10.5, 10.6, 10.8, 11.1], tokens=5)
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx((1.1 - 0.5) / 4)  # decode time over the 4 tokens after the first
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])  # gaps between chunks, not per token
    assert timeline(1, 0.0, [0.3], tokens=1).tpot is None  # one token: TPOT undefined


def test_percentile_matches_numpy_linear():
    rng = random.Random(5)
    values = [rng.random() for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_summary_throughput_goodput_and_failures():
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    good = timeline(0, 0.0, [0.5, 0.55, 0.6], tokens=3)  # ttft 0.5, tpot 0.05
    slow_first = timeline(1, 0.0, [1.5, 1.55], tokens=2)  # ttft 1.5 > 1.0
    slow_decode = timeline(2, 1.0, [1.2, 1.5, 1.8], tokens=3)  # tpot 0.3 > 0.1
    one_token = timeline(3, 2.0, [2.4], tokens=1)  # no TPOT: judged on TTFT alone, good
    failed = RequestTimeline(4, "mixed", 10, 3, send_s=0.0, error="HTTP 503")
    timelines = [good, slow_first, slow_decode, one_token, failed]
    assert [is_good(t, slo) for t in timelines] == [True, False, False, True, False]

    s = summarize(timelines, duration_s=4.0, slo=slo)
    assert (s.num_requests, s.num_ok) == (5, 4)
    assert s.output_tokens == 3 + 2 + 3 + 1  # the failed request counts nothing
    assert s.output_tps == pytest.approx(9 / 4.0)
    assert s.goodput_share == pytest.approx(2 / 5) and s.goodput_rps == pytest.approx(2 / 4.0)
    assert s.ttft["p50"] == pytest.approx(float(np.percentile([0.5, 1.5, 0.2, 0.4], 50)))
    assert s.tpot["mean"] == pytest.approx((0.05 + 0.05 + 0.3) / 3)
    all_gaps = [0.05, 0.05, 0.05, 0.3, 0.3]
    assert s.itl["p99"] == pytest.approx(float(np.percentile(all_gaps, 99)))
    assert s.e2e["p50"] == pytest.approx(float(np.percentile([0.6, 1.55, 0.8, 0.4], 50)))


def test_kv_utilization_is_a_ratio_of_sums():
    assert kv_utilization([(30, 32), (0, 0), (100, 112)]) == pytest.approx(130 / 144)
    assert math.isnan(kv_utilization([]))


def test_parse_metric_sums_labelled_samples():
    body = (
        "# HELP pdserve:kv_blocks_in_use x\npdserve:kv_blocks_in_use 12.0\n"
        'pdserve:kv_blocks_in_use_total 99\npdserve:request_success_total{finished_reason="length"} 3.0\n'
        'pdserve:request_success_total{finished_reason="stop"} 2.0\n'
    )
    assert parse_metric(body, "pdserve:kv_blocks_in_use") == 12.0
    assert parse_metric(body, "pdserve:request_success_total") == 5.0


def test_proc_parsing_reads_this_process():
    # A command name with spaces and parentheses must not shift the fields.
    fake = "42 (a b) c)) S 7 1 1 0 -1 0 0 0 0 0 250 150 0 0 20 0 1 0"
    assert parse_stat(fake) == (7, 400 / CLOCK_TICKS)
    assert parse_vm_hwm_mb("Name:\tx\nVmHWM:\t  2048 kB\n") == 2.0
    samples = sample_tree(os.getpid())
    me = samples[os.getpid()]
    assert me.cpu_s > 0 and me.peak_rss_mb > 10  # pytest has run and imported numpy


def test_mixed_workload_is_the_engine_benchmarks():
    from benchmarks.common.workload import WorkloadSpec, make_workload

    assert W.mixed(500, 16, seed=2) == make_workload(WorkloadSpec(vocab_size=500, num_requests=16, seed=2))


def test_rate_sweep_runs_share_no_prompt_block_with_each_other_or_the_closed_loops():
    # Found in the 2026-11-23 run: every rate replayed the same prompts, so the second rate's TTFT was
    # a prefix-cache hit (70 ms against 308 ms at the first rate).
    from protocol.hashing import block_hashes

    sweep = W.rate_sweep(32000, 12, (0.5, 1.0, 2.0), seed=0)
    assert [rate for rate, _ in sweep] == [0.5, 1.0, 2.0] and all(len(reqs) == 12 for _, reqs in sweep)
    runs = [reqs for _, reqs in sweep] + [W.mixed(32000, 32, seed=0), W.paced_mixed(32000, 32, seed=0)]
    first_blocks = [{block_hashes(list(r.prompt_token_ids), 16)[0] for r in reqs} for reqs in runs]
    assert sum(map(len, first_blocks)) == len(set().union(*first_blocks)) == 3 * 12 + 2 * 32


def test_shared_prefix_shape():
    spec = W.SharedPrefixSpec(vocab_size=300, num_requests=20, seed=1)
    requests = W.shared_prefix(spec)
    assert requests == W.shared_prefix(spec)
    prefixes = [r.prompt_token_ids[:384] for r in requests]
    assert len(set(prefixes)) == 4
    assert all(prefixes[i] == prefixes[i % 4] for i in range(20))
    assert all(32 <= r.prompt_len - 384 <= 128 for r in requests)
    assert all(16 <= r.output_len <= 64 for r in requests)
    assert all(0 <= t < 300 for r in requests for t in r.prompt_token_ids)


def test_poisson_offsets_have_the_rate():
    offsets = W.poisson_offsets(4000, rate_rps=5.0, seed=3)
    gaps = np.diff([0.0] + offsets)
    assert all(g > 0 for g in gaps)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 5.0, rel=0.1)  # exponential: std == mean
    assert W.poisson_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_interference_shape():
    spec = W.InterferenceSpec(vocab_size=400, num_short=30, short_rate_rps=2.0, num_bursts=3, burst_size=2, seed=4)
    schedule = W.interference(spec)
    assert schedule == W.interference(spec)
    shorts = [s for s in schedule if s.tag == "short"]
    longs = [s for s in schedule if s.tag == "long"]
    assert len(shorts) == 30 and len(longs) == 6
    assert [s.at_s for s in schedule] == sorted(s.at_s for s in schedule)
    assert sorted(s.request.index for s in schedule) == list(range(36))
    assert all(32 <= s.request.prompt_len <= 128 and 64 <= s.request.output_len <= 128 for s in shorts)
    assert all(s.request.prompt_len == 2048 and s.request.output_len == 8 for s in longs)
    horizon = max(s.at_s for s in shorts)
    burst_times = sorted({s.at_s for s in longs})
    assert burst_times == pytest.approx([horizon * (k + 0.5) / 3 for k in range(3)])


@pytest.mark.parametrize("quick", [True, False])
def test_interference_sample_supports_its_p99(quick):
    # The p99 (linear, numpy's) of n requests weighs the slowest by 0.99 * (n - 1) - (n - 2) where
    # that is positive: at 24 requests by 0.77, so the figure was one request's; from 101 on by 0.
    p = P.plan(quick)
    durations = np.arange(p.short_requests, dtype=float)
    assert np.percentile(durations, 99) <= durations[-2]
    other = P.plan(not quick)
    assert p.short_requests / p.num_bursts == other.short_requests / other.num_bursts  # same burst density


def test_select_narrows_the_plan_and_overrides_every_system():
    full = P.plan(quick=True)
    picked = P.select(
        full,
        ["coloc", "disagg"],
        ["interference", "prefix"],
        ["gateway.local_prefill_max_tokens=0", "engine.prefill_chunk_size=256", "engine.max_num_seqs=8"],
    )
    assert [(s.name, s.workloads) for s in picked.systems] == [
        ("disagg", ("prefix", "interference")),
        ("coloc", ("interference",)),
    ]  # quick coloc has no prefix
    for spec in picked.systems:
        assert spec.sections["gateway"] == {"local_prefill_max_tokens": 0}
        assert spec.sections["engine"] == {
            "enable_prefix_caching": True,
            "max_num_seqs": 8,
            "kv_cache_memory_mb": 1024,
            "prefill_chunk_size": 256,
        }
        assert spec.sections["model"] == {"max_model_len": 4096}
    assert (picked.short_requests, picked.num_bursts) == (full.short_requests, full.num_bursts)
    # unnarrowed: the whole plan but the opt-in variants, which run only where named
    assert P.select(full).systems == tuple(s for s in full.systems if not s.opt_in)
    assert full.systems[0].sections["engine"]["max_num_seqs"] == 64  # the plan itself is untouched


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (["disag"], None, []),
            "unknown system(s) ['disag']; choose from ['disagg', 'coloc', 'nocache', 'llama', 'disagg-int8', 'coloc-q8', 'llama-q8', 'coloc-q4', 'llama-q4', 'coloc-q4km', 'llama-q4km', 'coloc-bf16', 'llama-bf16', 'coloc-f16', 'llama-f16', 'coloc-q8-int16', 'coloc-q4-int16', 'coloc-spec', 'coloc-nospec', 'llama-spec']",
        ),
        ((None, ["mixed"], []), "unknown workload(s) ['mixed']"),
        (
            (None, None, ["local_prefill_max_tokens=0"]),
            "override 'local_prefill_max_tokens=0' is not SECTION.KEY=VALUE",
        ),
        ((None, None, ["gateway.x"]), "override 'gateway.x' is not SECTION.KEY=VALUE"),
    ],
)
def test_select_names_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        P.select(P.plan(quick=False), *args)


def test_base_url_measures_a_running_server_with_the_same_workloads(tok_dir, tmp_path):
    """--base-url against a live gateway (fake workers answering a fixed text): no system is started,
    the closed-loop runs happen, every request reaches the server (its /metrics count them), and the
    ones the benchmark counts as complete are exactly those asking for no more tokens than the text has."""
    import json

    import httpx

    from benchmarks.serve.run import main
    from gateway.serving.pipeline import ServingLimits
    from tests import prom
    from tests.fake_backend import API_KEYS, MODEL, live_gateway

    limits = ServingLimits(MODEL, 1 << 20, max_concurrent_requests=256)  # no 503: every request is answered
    with live_gateway(tok_dir, limits=limits) as live:
        text_tokens = len(live.backend.output_ids)
        assert (
            main(
                [
                    "--base-url",
                    f"{live.base_url}/v1",
                    "--api-key",
                    API_KEYS[0],
                    "--model",
                    str(tok_dir),
                    "--quick",
                    "--workloads",
                    "mixed_closed",
                    "--json",
                    str(tmp_path / "out.json"),
                ]
            )
            == 0
        )
        metrics = httpx.get(f"{live.base_url}/metrics").text
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [(r["system"], r["workload"], r["load"]) for r in runs] == [
        ("endpoint", "mixed", "closed c=16"),
        ("endpoint", "mixed", "all at once"),
    ]
    plan = P.plan(quick=True)
    sent = [W.paced_mixed(300, plan.closed_requests, 0), W.mixed(300, plan.closed_requests, 0)]
    assert [r["num_requests"] for r in runs] == [len(s) for s in sent]
    assert [r["num_ok"] for r in runs] == [sum(q.output_len <= text_tokens for q in s) for s in sent]
    served = sum(len(s) for s in sent) + 2  # and the warm-up's two
    assert prom.total(metrics, "pdserve:requests_total", outcome="success") == served
    assert prom.samples(metrics, "vllm:e2e_request_latency_seconds_count", model_name=MODEL) == [served]


def test_insecure_twins_run_each_system_with_and_without_curve():
    picked = P.with_insecure_twins(P.select(P.plan(quick=True), ["disagg"], ["mixed_closed"]))
    assert [(s.name, s.workloads) for s in picked.systems] == [
        ("disagg", ("mixed_closed",)),
        ("disagg-insecure", ("mixed_closed",)),
    ]
    assert "transfer" not in picked.systems[0].sections
    assert picked.systems[1].sections["transfer"] == {"insecure": True}
    assert picked.systems[1].sections["engine"] == picked.systems[0].sections["engine"]
