"""benchmarks/serve/kv_dtype_ratios.py: disagg-int8 over disagg per streams concurrency, nan where a run
is missing."""

from __future__ import annotations

import math

from benchmarks.common.metrics import Summary
from benchmarks.serve.kv_dtype_ratios import int8_vs_auto
from benchmarks.serve.report import Report, Run, streams_load


def run(system: str, c: int, tokens: int, ttft_p99: float, itl_p50: float) -> Run:
    stats = {"p50": itl_p50, "p90": 0.0, "p99": ttft_p99, "mean": 0.0}
    summary = Summary(c, c, 10.0, tokens, dict(stats), dict(stats), dict(stats), dict(stats), 1.0, 1.0)
    return Run(system, "streams", streams_load(c), math.inf, summary)


def test_int8_over_auto_per_concurrency_and_nan_for_a_missing_run():
    report = Report(
        runs=[
            run("disagg", 16, 1000, 2.0, 0.10),
            run("disagg-int8", 16, 1200, 1.5, 0.08),
            run("disagg", 32, 1500, 4.0, 0.2),
            run("disagg-int8", 1, 100, 0.1, 0.05),  # no auto run at c=1
        ]
    )
    got = int8_vs_auto(report, (1, 16, 32))
    assert got["int8_vs_auto_tps_16"] == 1.2
    assert got["int8_ttft_p99_vs_auto_16"] == 0.75
    assert math.isclose(got["int8_itl_p50_vs_auto_16"], 0.8)
    assert math.isnan(got["int8_vs_auto_tps_1"]) and math.isnan(got["int8_vs_auto_tps_32"])
    assert list(got) == [
        f"{k}_{c}" for k in ("int8_vs_auto_tps", "int8_ttft_p99_vs_auto", "int8_itl_p50_vs_auto") for c in (1, 16, 32)
    ]
