"""The ``--kv-cache-dtype`` workload pair's headlines (issue #45): disagg-int8 (the same layout with
``--kv-cache-dtype int8``) against disagg (``auto``) on the streams workload, per concurrency ``c``:

- int8_vs_auto_tps_<c>: output tokens/s, int8 over auto (target at 32 streams: >= 1.0);
- int8_ttft_p99_vs_auto_<c>: TTFT p99, int8 over auto (target at 32 streams: <= 1.0, no worse);
- int8_itl_p50_vs_auto_<c>: ITL p50, int8 over auto (< 1: int8's decode steps are quicker).

nan where either run is missing (a system or workload not selected, or a run that failed)."""

from __future__ import annotations

import math

from benchmarks.serve.report import Report

AUTO, INT8 = "disagg", "disagg-int8"
KEYS = (("tps", "int8_vs_auto_tps"), ("ttft_p99", "int8_ttft_p99_vs_auto"), ("itl_p50", "int8_itl_p50_vs_auto"))


def _figure(report: Report, system: str, c: int, what: str) -> float:
    run = report.stream(system, c)
    if run is None:
        return math.nan
    s = run.summary
    return {"tps": s.output_tps, "ttft_p99": s.ttft["p99"], "itl_p50": s.itl["p50"]}[what]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def int8_vs_auto(report: Report, concurrencies: tuple[int, ...]) -> dict[str, float]:
    out = {}
    for what, key in KEYS:
        for c in concurrencies:
            out[f"{key}_{c}"] = _ratio(_figure(report, INT8, c, what), _figure(report, AUTO, c, what))
    return out
