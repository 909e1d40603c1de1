"""The serving benchmark's same-GGUF comparison (benchmarks/serve/gguf_systems.py): the plan pairs pdserve
and llama-server on each format's file at 1 and 16 streams, and the headlines divide the right runs."""

from __future__ import annotations

import math

import benchmarks.serve.plan as P
from benchmarks.common.metrics import RequestTimeline, Slo, summarize
from benchmarks.serve.gguf_systems import gguf_headlines
from benchmarks.serve.report import Report, make_run, streams_load


def _stream(system: str, c: int, tps: float, itl: float, ttft: float):
    timelines = [
        RequestTimeline(i, "x", 8, 10, 0.0, [ttft + k * itl for k in range(10)], output_tokens=10) for i in range(4)
    ]
    return make_run(system, "streams", streams_load(c), math.inf, summarize(timelines, 40 / tps, Slo(9, 9)), timelines)


def test_plan_pairs_pdserve_and_llama_on_the_same_file():
    for quick in (True, False):
        gguf = [s for s in P.plan(quick).systems if s.gguf]
        assert [(s.name, s.gguf, s.llama is not None) for s in gguf] == [
            ("coloc-q8", "q8_0", False),
            ("llama-q8", "q8_0", True),
            ("coloc-q4", "q4_1", False),
            ("llama-q4", "q4_1", True),
            ("coloc-q4km", "q4_k_m", False),
            ("llama-q4km", "q4_k_m", True),
            ("coloc-bf16", "bf16", False),
            ("llama-bf16", "bf16", True),
            ("coloc-f16", "f16", False),
            ("llama-f16", "f16", True),
            ("coloc-q8-int16", "q8_0", False),
            ("coloc-q4-int16", "q4_1", False),
        ]
        # the two-term variants: their file's pdserve with model.quant_activations int16, run only when named
        variants = {s.name: s for s in gguf if s.opt_in}
        assert sorted(variants) == ["coloc-q4-int16", "coloc-q8-int16"]
        assert all(s.sections["model"]["quant_activations"] == "int16" for s in variants.values())
        assert not set(variants) & {s.name for s in P.select(P.plan(quick)).systems}
        assert [s.name for s in P.select(P.plan(quick), ["coloc-q8-int16"]).systems] == ["coloc-q8-int16"]
        for spec in gguf:
            assert spec.workloads == ("streams",) and spec.stream_levels == (1, 16)
            assert spec.llama in (None, P.LLAMA_CONFIG) and spec.num_prefill == 0
        others = [s for s in P.plan(quick).systems if not s.gguf and "spec" not in s.workloads]  # spec: 1, 4, 16
        assert all(s.stream_levels == P.STREAM_CONCURRENCIES for s in others)


def test_gguf_headlines_from_known_runs():
    report = Report()
    report.runs = [
        _stream("coloc-q8", 1, 60.0, 0.010, 0.05),
        _stream("llama-q8", 1, 50.0, 0.012, 0.04),
        _stream("coloc-q8", 16, 300.0, 0.030, 2.0),
        _stream("llama-q8", 16, 150.0, 0.050, 4.0),
        _stream("coloc-q4", 1, 40.0, 0.020, 0.05),
        _stream("llama-q4", 1, 50.0, 0.010, 0.05),
        _stream("llama-q4", 16, 70.0, 0.100, 9.0),  # pdserve's q4 run at 16 is missing: nan
        _stream("coloc-q4km", 1, 45.0, 0.020, 0.05),
        _stream("llama-q4km", 1, 30.0, 0.030, 0.05),
        _stream("coloc-bf16", 16, 200.0, 0.040, 3.0),
        _stream("llama-bf16", 16, 100.0, 0.080, 6.0),
    ]
    ratios, latency = gguf_headlines(report)
    assert list(ratios) == [
        "vs_llama_q8_1",
        "vs_llama_q8_16",
        "vs_llama_q4_1",
        "vs_llama_q4_16",
        "vs_llama_q4km_1",
        "vs_llama_q4km_16",
        "vs_llama_bf16_1",
        "vs_llama_bf16_16",
        "vs_llama_f16_1",
        "vs_llama_f16_16",
    ]
    assert ratios["vs_llama_q8_1"] == 60.0 / 50.0 and ratios["vs_llama_q8_16"] == 300.0 / 150.0
    assert ratios["vs_llama_q4_1"] == 40.0 / 50.0 and math.isnan(ratios["vs_llama_q4_16"])
    assert ratios["vs_llama_q4km_1"] == 45.0 / 30.0 and math.isnan(ratios["vs_llama_q4km_16"])  # no run at 16
    assert ratios["vs_llama_bf16_16"] == 200.0 / 100.0 and math.isnan(ratios["vs_llama_bf16_1"])
    assert math.isclose(latency["ttft_p99_vs_llama_bf16_16"], 2.0) and math.isnan(latency["vs_llama_bf16_1_itl"])
    # ITL p50 is read from the timelines' chunk gaps, so equal up to rounding
    assert math.isclose(latency["vs_llama_q8_1_itl"], 1.2) and math.isclose(latency["vs_llama_q4_1_itl"], 0.5)
    assert math.isclose(latency["ttft_p99_vs_llama_q8_16"], 2.0) and math.isnan(latency["ttft_p99_vs_llama_q4_16"])
