"""PNG plots of a serving-benchmark report (matplotlib, the optional ``plots`` extra).

    python -m benchmarks.serve --plots-dir DIR        plots as the run ends
    python -m benchmarks.serve.plots RUN.json DIR           plots of a run saved with --json

- latency vs request rate per system (TTFT p50 and TPOT p50 of the mixed workload's Poisson runs)
- TPOT distribution of the short requests under interference (one CDF per system)
- output throughput per system (mixed, all requests at once) next to transformers static batching
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from benchmarks.serve.report import ALL_AT_ONCE, Report, read_json


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    systems = sorted({r.system for r in report.runs})

    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for system in systems:
        runs = sorted(
            (r for r in report.runs if r.system == system and r.workload == "mixed" and math.isfinite(r.rate_rps)),
            key=lambda r: r.rate_rps,
        )
        if runs:
            rates = [r.rate_rps for r in runs]
            ax_ttft.plot(rates, [r.summary.ttft["p50"] for r in runs], marker="o", label=system)
            ax_tpot.plot(rates, [r.summary.tpot["p50"] * 1000 for r in runs], marker="o", label=system)
    ax_ttft.set(xlabel="request rate (req/s, Poisson)", ylabel="TTFT p50 (s)", title="mixed workload: TTFT")
    ax_tpot.set(xlabel="request rate (req/s, Poisson)", ylabel="TPOT p50 (ms)", title="mixed workload: TPOT")
    for ax in (ax_ttft, ax_tpot):
        ax.legend()
        ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out_dir / "serve_latency_vs_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in systems:
        run = report.find(system, "interference:short")
        if run and run.tpots:
            xs = sorted(t * 1000 for t in run.tpots)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=system)
    ax.set(xlabel="TPOT of short requests (ms)", ylabel="fraction of requests", title="TPOT under interference")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out_dir / "serve_tpot_interference.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names, values = [], []
    if math.isfinite(report.hf_tps):
        names.append("hf static b=16")
        values.append(report.hf_tps)
    for system in systems:
        run = report.find(system, "mixed", ALL_AT_ONCE)
        if run:
            names.append(system)
            values.append(run.summary.output_tps)
    ax.bar(names, values)
    ax.set(ylabel="output tokens/s", title="mixed workload throughput")
    paths.append(save_figure(fig, out_dir / "serve_throughput.png"))
    return paths


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


if __name__ == "__main__":
    for written in write_plots(read_json(Path(sys.argv[1])), Path(sys.argv[2])):
        print(f"plot: {written}")
