"""PNG plots of the scaling benchmark (matplotlib, the optional ``plots`` extra): one figure per sweep,
panels output throughput / TTFT p50 and p99 / ITL p50 and p99 against the sweep's axis (log-x), one
colour per system, p50 solid (filled circles) and p99 dashed (open triangles)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scaling.plan import CONCURRENCY, PROMPT_LEN
from benchmarks.scaling.report import Point
from benchmarks.serve.plots import save_figure

FILE_NAMES = {CONCURRENCY: "scaling_vs_concurrency.png", PROMPT_LEN: "scaling_vs_prompt_len.png"}
X_LABELS = {CONCURRENCY: "concurrent requests (closed loop)", PROMPT_LEN: "prompt tokens"}


def figure(points: list[Point], axis: str, title: str):
    """The figure of ``axis``'s points (those of the other sweep left out); lines labelled
    ``<system>`` (throughput) and ``<system> p50`` / ``<system> p99`` (latencies, milliseconds)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(15, 4.2))
    systems = list(dict.fromkeys(p.system for p in points if p.axis == axis))  # in the order measured
    for colour, system in enumerate(systems):
        mine = sorted((p for p in points if p.axis == axis and p.system == system), key=lambda p: p.x)
        xs = [p.x for p in mine]
        ax_tps.plot(xs, [p.summary.output_tps for p in mine], color=f"C{colour}", marker="o", label=system)
        for ax, metric in ((ax_ttft, "ttft"), (ax_itl, "itl")):
            for q, dash, marker in (("p50", "-", "o"), ("p99", "--", "^")):
                values = [getattr(p.summary, metric)[q] * 1000 for p in mine]
                ax.plot(
                    xs,
                    values,
                    linestyle=dash,
                    marker=marker,
                    mfc="none" if q == "p99" else None,
                    color=f"C{colour}",
                    label=f"{system} {q}",
                )
    ticks = sorted({p.x for p in points if p.axis == axis})
    ax_tps.set(ylabel="output tokens/s", title="served output throughput")
    ax_ttft.set(ylabel="TTFT (ms)", title="time to first token", yscale="log")
    ax_itl.set(ylabel="ITL (ms)", title="inter-token latency", yscale="log")
    for ax in (ax_tps, ax_ttft, ax_itl):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(x) for x in ticks])  # the measured values, not powers of two
        ax.minorticks_off()
        ax.set_xlabel(X_LABELS[axis])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}\n{_what(points, axis)}", fontsize=9)
    return fig


def _what(points: list[Point], axis: str) -> str:
    first = next(p for p in points if p.axis == axis)
    if axis == CONCURRENCY:
        return f"closed loops of {first.prompt_len} prompt / {first.output_len} output tokens"
    return f"closed loops of {first.concurrency} requests in flight, {first.output_len} output tokens"


def write_scaling_plots(points: list[Point], out_dir: Path, title: str) -> list[Path]:
    """A PNG per sweep that has points, in ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        save_figure(figure(points, axis, title), out_dir / name)
        for axis, name in FILE_NAMES.items()
        if any(p.axis == axis for p in points)
    ]
