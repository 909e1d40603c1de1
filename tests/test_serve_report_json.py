"""A serving-benchmark run saved with ``--json`` reads back as the report it was (``read_json``), so its
plots can be drawn again from the file (``python -m benchmarks.serve.plots RUN.json DIR``)."""

from __future__ import annotations

import math

from benchmarks.common.metrics import Summary
from benchmarks.serve.plots import write_plots
from benchmarks.serve.report import Report, Run, read_json, write_json


def stats(p50: float, p99: float) -> dict[str, float]:
    return {"mean": p50, "p50": p50, "p90": p99, "p99": p99}


def test_a_saved_run_reads_back_whole_and_plots(tmp_path):
    summary = Summary(8, 8, 2.0, 512, stats(0.1, 0.2), stats(0.01, 0.02), stats(0.01, 0.03), stats(1.0, 2.0), 1.0, 4.0)
    report = Report(
        runs=[
            Run("disagg", "mixed", "poisson 1 rps", 1.0, summary, []),
            Run("disagg", "mixed", "all at once", math.inf, summary, []),
            Run("coloc", "interference:short", "1.5 rps+bursts", 1.5, summary, [0.007, 0.015]),
        ],
        hf_tps=190.0,
        hf_by_batch={16: 190.0, 64: 250.0},
    )
    write_json(report, tmp_path / "run.json", {"quick": True})
    again = read_json(tmp_path / "run.json")
    assert again.runs == report.runs  # the infinite rate of a closed loop included
    assert (again.hf_tps, again.hf_by_batch) == (190.0, {16: 190.0, 64: 250.0})
    assert again.runs[1].summary.output_tps == 256.0
    written = write_plots(again, tmp_path / "plots")
    assert sorted(p.name for p in written) == [
        "serve_latency_vs_rate.png",
        "serve_throughput.png",
        "serve_tpot_interference.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
