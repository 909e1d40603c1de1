"""The scaling benchmark's pure parts against hand-made expectations (no server): the levels of its two
sweeps and their prompts, the duration estimate, the table and JSON of given summaries, the header's
CPU name, the plots' series, and transformers' step timelines on a tiny checkpoint."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from benchmarks.common.metrics import Summary
from benchmarks.common.workload import BenchRequest
from benchmarks.scaling import plan as P
from benchmarks.scaling.report import HF_NOTE, Point, cpu_model, table, write_json

VOCAB = 1000


def stats(p50: float, p99: float) -> dict[str, float]:
    return {"mean": p50, "p50": p50, "p90": p99, "p99": p99}


def summary(tokens: int, duration: float, ttft: tuple[float, float], itl: tuple[float, float], n: int = 4) -> Summary:
    return Summary(n, n, duration, tokens, stats(*ttft), stats(0.01, 0.02), stats(*itl), stats(1.0, 2.0), 1.0, 1.0)


def test_levels_are_the_two_sweeps_with_their_sizes():
    sweep = P.Sweep((1, 4, 16), (128, 512), prompt_concurrency=4, rounds=2, min_requests=8)
    got = [(lv.axis, lv.concurrency, lv.prompt_len, lv.output_len, len(lv.requests)) for lv in P.levels(VOCAB, sweep)]
    assert got == [
        ("concurrency", 1, 256, 128, 8),  # 2 rounds of one stream, raised to the minimum of 8
        ("concurrency", 4, 256, 128, 8),
        ("concurrency", 16, 256, 128, 32),  # 2 rounds of 16
        ("prompt_len", 4, 128, 128, 8),
        ("prompt_len", 4, 512, 128, 8),
    ]
    assert [lv.x for lv in P.levels(VOCAB, sweep)] == [1, 4, 16, 128, 512]
    assert P.levels(VOCAB, P.Sweep((), (), 4, 2, 8)) == []


def test_no_two_prompts_in_a_run_share_a_cache_block():
    # Prompt-length levels of different lengths from one seed would be prefixes of each other; every
    # request of every level must start with a 16-token block no other request has.
    sweep = P.Sweep((1, 4, 16, 32, 64), (128, 512, 1024), prompt_concurrency=4, rounds=1, min_requests=2)
    requests = [r for lv in P.levels(VOCAB, sweep) for r in lv.requests]
    first_blocks = [r.prompt_token_ids[:16] for r in requests]
    assert len(set(first_blocks)) == len(requests) == 2 + 4 + 16 + 32 + 64 + 3 * 4
    assert all(0 <= t < VOCAB for r in requests for t in r.prompt_token_ids)
    assert P.levels(VOCAB, sweep) == P.levels(VOCAB, sweep)  # seeded: the same requests every run


def level(axis: str, concurrency: int, prompt_len: int, count: int) -> P.Level:
    requests = tuple(BenchRequest(i, (1,) * prompt_len, 128) for i in range(count))
    return P.Level(axis, concurrency, prompt_len, 128, requests)


def test_longest_request_servers_and_estimate():
    levels = [level("concurrency", 1, 256, 2), level("concurrency", 4, 256, 4), level("prompt_len", 4, 1024, 4)]
    assert P.longest_request(levels) == 1024 + 128
    assert P.servers("llama", levels) == 2  # --parallel 1 and --parallel 4 (the prompt levels share it)
    assert P.servers("coloc", levels) == 1
    # By hand: decode at min(60 c, 450) tok/s plus 2.5 us per token of a row's mean context (prompt +
    # 64) per step, prefill at 1500 tok/s, 30 s per server start.
    one_system = (
        2 * 128 * (1 / 60 + 320 * 2.5e-6)
        + 2 * 256 / 1500
        + 4 * 128 * (1 / 240 + 320 * 2.5e-6)
        + 4 * 256 / 1500
        + 4 * 128 * (1 / 240 + 1088 * 2.5e-6)
        + 4 * 1024 / 1500
    )
    assert P.estimate_s(levels, ["coloc", "llama"]) == pytest.approx(2 * one_system + (1 + 2) * 30)
    assert P.minutes(61) == "~2 min"


def test_table_has_a_row_per_point_and_the_hf_note():
    points = [
        Point("coloc", "concurrency", 4, 256, 128, summary(512, 2.0, (0.2204, 0.3), (0.0125, 0.02))),
        Point("hf", "prompt_len", 4, 1024, 128, summary(512, 4.0, (0.5, 0.6), (math.nan, math.nan))),
    ]
    lines = table(points).splitlines()
    assert lines[2] == "| coloc | concurrency | 4 | 256 | 128 | 4/4 | 256.0 | 220 | 300 | 12.5 | 20.0 |"
    assert lines[3] == "| hf | prompt_len | 4 | 1024 | 128 | 4/4 | 128.0 | 500 | 600 | — | — |"
    assert lines[-1] == f"({HF_NOTE})"
    assert HF_NOTE not in table(points[:1])


def test_json_holds_every_point(tmp_path):
    points = [Point("disagg", "concurrency", 16, 256, 128, summary(2048, 8.0, (1.0, 2.0), (0.03, 0.05), n=16))]
    path = tmp_path / "out" / "scaling.json"
    write_json(points, path, {"header": "cpu"})
    record = json.loads(path.read_text())
    assert record["meta"] == {"header": "cpu"}
    [row] = record["points"]
    assert (row["system"], row["axis"], row["concurrency"], row["prompt_len"]) == ("disagg", "concurrency", 16, 256)
    assert row["output_tps"] == 256.0 and row["ttft"]["p99"] == 2.0 and row["itl"]["p50"] == 0.03
    assert row["num_requests"] == 16


def test_cpu_model_reads_proc_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: x\n"
    assert cpu_model(text) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model("processor : 0\n")  # no model name (e.g. some ARM kernels): platform's name instead


def test_plots_draw_a_line_per_system_and_write_only_swept_axes(tmp_path):
    from benchmarks.scaling.plots import figure, write_scaling_plots

    points = [
        Point(system, "concurrency", c, 256, 128, summary(int(tps * 10), 10.0, (c * 0.1, c * 0.2), (0.01, 0.03)))
        for system, rates in (("disagg", {1: 50.0, 4: 150.0}), ("llama", {1: 100.0, 4: 120.0}))
        for c, tps in rates.items()
    ]
    fig = figure(points, "concurrency", "title")
    ax_tps, ax_ttft, ax_itl = fig.axes
    assert [line.get_label() for line in ax_tps.get_lines()] == ["disagg", "llama"]
    assert [list(line.get_ydata()) for line in ax_tps.get_lines()] == [[50.0, 150.0], [100.0, 120.0]]
    assert [list(line.get_xdata()) for line in ax_tps.get_lines()] == [[1, 4], [1, 4]]
    labels = [line.get_label() for line in ax_ttft.get_lines()]
    assert labels == ["disagg p50", "disagg p99", "llama p50", "llama p99"]
    assert list(ax_ttft.get_lines()[1].get_ydata()) == pytest.approx([200.0, 800.0])  # ms
    assert list(ax_itl.get_lines()[0].get_ydata()) == pytest.approx([10.0, 10.0])
    assert ax_tps.get_xscale() == "log"

    paths = write_scaling_plots(points, tmp_path, "title")
    assert [p.name for p in paths] == ["scaling_vs_concurrency.png"]  # no prompt-length point: no such plot
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformers_timelines_follow_its_batches():
    from benchmarks.peers import hf_baseline
    from tests.model_factory import tiny_model_dir

    model = hf_baseline.load_hf_model(tiny_model_dir("llama"))
    clock = hf_baseline.StepClock()
    hf_baseline.generate_batch(model, [(5, 6, 7)], 4, streamer=clock)
    assert (clock.num_puts, len(clock.step_s)) == (1 + 4, 4)  # the prompt, then one put per step

    requests = [BenchRequest(0, (3, 4, 5), 4), BenchRequest(1, (6, 7, 8), 2), BenchRequest(2, (9, 10, 11), 3)]
    timelines, duration = hf_baseline.timed_static_batching(model, requests, batch_size=2, tag="t")
    assert [(t.index, len(t.chunk_s), t.output_tokens, t.ok) for t in timelines] == [
        (0, 4, 4, True),
        (1, 2, 2, True),  # the batch decodes 4 steps; this request's tokens are the first 2
        (2, 3, 3, True),
    ]
    first, second, third = timelines
    assert first.send_s == second.send_s and second.chunk_s == first.chunk_s[:2]
    assert third.send_s >= first.chunk_s[-1]  # the second batch starts after the first ends
    assert all(t.chunk_s == sorted(t.chunk_s) and t.chunk_s[0] > t.send_s for t in timelines)
    assert duration >= third.chunk_s[-1] - first.send_s


def test_served_levels_reach_the_server_in_closed_loops(tok_dir):
    """Against a live gateway over fake workers: each level's requests all reach it (its /metrics count
    them, with the warm-up's two) and the server is let settle after the warm-up and after each level.
    The fake answers a fixed text shorter than 128 tokens, so the client counts none of them complete."""
    from benchmarks.common.client import Target
    from benchmarks.common.workload import prompt_vocab
    from benchmarks.scaling.run import measure
    from gateway.serving.pipeline import ServingLimits
    from tests import prom
    from tests.fake_backend import API_KEYS, MODEL, live_gateway

    vocab = prompt_vocab(tok_dir)
    levels = P.levels(vocab, P.Sweep((1, 2), (8,), prompt_concurrency=2, rounds=1, min_requests=3))
    settled = []
    with live_gateway(tok_dir, limits=ServingLimits(MODEL, 1 << 20, max_concurrent_requests=64)) as live:
        target = Target(live.base_url, MODEL, API_KEYS[0])
        points = measure("fake", target, levels, vocab, lambda: settled.append(1))
        metrics = httpx.get(f"{live.base_url}/metrics").text
    assert [(p.system, p.axis, p.x, p.summary.num_requests, p.summary.num_ok) for p in points] == [
        ("fake", "concurrency", 1, 3, 0),
        ("fake", "concurrency", 2, 3, 0),  # max(1 round x 2, 3)
        ("fake", "prompt_len", 8, 3, 0),
    ]
    assert len(settled) == 1 + len(levels)
    assert prom.total(metrics, "pdserve:requests_total") == 2 + 3 * 3
