"""The serving benchmark's tables, targets and headline (plain text on stdout), and its JSON record."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from benchmarks.common.metrics import RequestTimeline, Summary
from benchmarks.common.procs import ProcSample

TARGET_VS_STATIC = 2.0
TARGET_TPOT_RATIO = 0.5
TARGET_PREFIX_GAIN = 3.0
TARGET_KV_UTIL = 0.95
# The load of the served-throughput run: every mixed request sent at time 0 (vLLM's --request-rate inf),
# so the server batches as it sees fit; the baseline batches 16 at a time over the same requests.
ALL_AT_ONCE = "all at once"
PDSERVE_LAYOUTS = ("disagg", "coloc")  # "pdserve's best layout" is the better of these, per figure
LLAMA = "llama"


def streams_load(concurrency: int) -> str:
    """The load label of the streams workload's closed loop at ``concurrency``."""
    return f"streams c={concurrency}"


@dataclass(slots=True)
class Run:
    system: str
    workload: str  # "mixed", "prefix", "interference:short", ...
    load: str  # "closed c=16", "poisson 1.0 rps"
    rate_rps: float  # offered rate (inf for closed loop)
    summary: Summary
    tpots: list[float] = field(default_factory=list)  # per request, for the distribution plot


@dataclass(slots=True)
class Report:
    runs: list[Run] = field(default_factory=list)
    procs: list[tuple[str, ProcSample]] = field(default_factory=list)  # (system, process)
    hf_tps: float = math.nan  # static batching at batch 16: the first headline's baseline, as defined
    hf_row: str = ""
    hf_by_batch: dict[int, float] = field(default_factory=dict)  # batch size -> output tokens/s
    kv_util: dict[str, tuple[float, int, int]] = field(
        default_factory=dict
    )  # system -> (util, busy samples, failed scrapes)

    def find(self, system: str, workload: str, load_prefix: str = "") -> Run | None:
        return next(
            (r for r in self.runs if r.system == system and r.workload == workload and r.load.startswith(load_prefix)),
            None,
        )

    def stream(self, system: str, concurrency: int) -> Run | None:
        """The streams run at exactly ``concurrency`` (``find``'s prefix would take c=16 for c=1)."""
        load = streams_load(concurrency)
        return next((r for r in self.runs if r.system == system and r.workload == "streams" and r.load == load), None)


def make_run(
    system: str, workload: str, load: str, rate: float, summary: Summary, timelines: list[RequestTimeline]
) -> Run:
    tpots = [t.tpot for t in timelines if t.ok and t.tpot is not None]
    return Run(system, workload, load, rate, summary, tpots)


HEADER = (
    f"{'system':<14}{'workload':<20}{'load':<17}{'ok':>7}{'out tok/s':>10}{'TTFT p50':>9}{'p99':>8}"
    f"{'TPOT p50':>9}{'p99':>8}{'ITL p99':>8}{'e2e p50':>8}{'good':>6}"
)


def _ms(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x * 1000:.0f}"


def run_row(r: Run) -> str:
    s = r.summary
    return (
        f"{r.system:<14}{r.workload:<20}{r.load:<17}{f'{s.num_ok}/{s.num_requests}':>7}{s.output_tps:>10.1f}"
        f"{_ms(s.ttft['p50']):>9}{_ms(s.ttft['p99']):>8}{_ms(s.tpot['p50']):>9}{_ms(s.tpot['p99']):>8}"
        f"{_ms(s.itl['p99']):>8}{_ms(s.e2e['p50']):>8}{s.goodput_share:>6.2f}"
    )


def print_procs(report: Report) -> None:
    print(f"\n{'system':<14}{'process':<16}{'CPU-s':>8}{'peak RSS MB':>13}   (CPU over the measured runs)")
    for system, p in report.procs:
        print(f"{system:<14}{p.name:<16}{p.cpu_s:>8.1f}{p.peak_rss_mb:>13.0f}")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def print_targets(report: Report) -> tuple[float, float, float]:
    """The four targets next to the measured values; returns the headline's three numbers."""
    served = report.find("disagg", "mixed", ALL_AT_ONCE)
    vs_static = _ratio(served.summary.output_tps if served else math.nan, report.hf_tps)
    dis, col = report.find("disagg", "interference:short"), report.find("coloc", "interference:short")
    tpot_ratio = _ratio(dis.summary.tpot["p99"] if dis else math.nan, col.summary.tpot["p99"] if col else math.nan)
    cached, uncached = report.find("disagg", "prefix"), report.find("nocache", "prefix")
    gain = _ratio(
        uncached.summary.ttft["p50"] if uncached else math.nan, cached.summary.ttft["p50"] if cached else math.nan
    )
    print("\ntargets:")
    for what, value, target, met in (
        (
            "mixed output throughput, disagg all requests at once / hf static batch=16",
            vs_static,
            f">= {TARGET_VS_STATIC}",
            vs_static >= TARGET_VS_STATIC,
        ),
        (
            "interference short-request TPOT p99, disagg / coloc",
            tpot_ratio,
            f"<= {TARGET_TPOT_RATIO}",
            tpot_ratio <= TARGET_TPOT_RATIO,
        ),
        ("shared-prefix TTFT p50, cache off / cache on", gain, f">= {TARGET_PREFIX_GAIN}", gain >= TARGET_PREFIX_GAIN),
    ):
        verdict = "not measured: a run it needs was left out" if math.isnan(value) else f"{value:.2f} {_verdict(met)}"
        print(f"  {what}: {verdict} (target {target})")
    for system, (util, n, failed) in report.kv_util.items():
        print(
            f"  KV memory utilisation ({system} decode, pdserve:kv_live_slots / slots of kv_blocks_in_use, "
            f"{n} busy samples, {failed} failed scrapes): {util:.3f} (target >= {TARGET_KV_UTIL}) "
            f"{_verdict(util >= TARGET_KV_UTIL)}"
        )
    return vs_static, tpot_ratio, gain


def _value(run: Run | None, what: str) -> float:
    """A run's figure: "tps" (output tokens/s), "itl_p50" or "ttft_p99" (seconds); nan for no run."""
    if run is None:
        return math.nan
    s = run.summary
    return {"tps": s.output_tps, "itl_p50": s.itl["p50"], "ttft_p99": s.ttft["p99"]}[what]


def _best_layout(report: Report, concurrency: int) -> Run | None:
    """pdserve's layout with the most output tokens/s on the streams workload at ``concurrency``."""
    runs = [r for r in (report.stream(name, concurrency) for name in PDSERVE_LAYOUTS) if r is not None]
    return max(runs, key=lambda r: r.summary.output_tps, default=None)


def equal_concurrency(report: Report, concurrencies: tuple[int, ...]) -> dict[str, float]:
    """The headlines at equal concurrency (defined before any was measured; nan where a run is missing):

    - vs_hf_static_equal_concurrency: disagg's mixed closed loop of 16 over transformers at batch 16;
    - vs_hf_best_batch: disagg, mixed all at once, over transformers at its best batch size;
    - vs_llama_<c>: pdserve's best layout over llama-server, output tokens/s, streams at c;
    - vs_llama_1_itl: llama-server's ITL p50 at one stream over the lower of pdserve's layouts' (>= 1:
      pdserve's is at or below);
    - ttft_p99_vs_llama_<c> (c > 1): llama-server's TTFT p99 over that of pdserve's best layout at c
      (>= 1: pdserve's tail is no worse).
    """
    closed, served = report.find("disagg", "mixed", "closed"), report.find("disagg", "mixed", ALL_AT_ONCE)
    out = {
        "vs_hf_static_equal_concurrency": _ratio(_value(closed, "tps"), report.hf_by_batch.get(16, math.nan)),
        "vs_hf_best_batch": _ratio(_value(served, "tps"), max(report.hf_by_batch.values(), default=math.nan)),
    }
    for c in concurrencies:
        out[f"vs_llama_{c}"] = _ratio(_value(_best_layout(report, c), "tps"), _value(report.stream(LLAMA, c), "tps"))
    if 1 in concurrencies:
        itls = [_value(report.stream(name, 1), "itl_p50") for name in PDSERVE_LAYOUTS]
        finite = [x for x in itls if not math.isnan(x)]
        out["vs_llama_1_itl"] = _ratio(_value(report.stream(LLAMA, 1), "itl_p50"), min(finite, default=math.nan))
    for c in concurrencies:
        if c > 1:
            out[f"ttft_p99_vs_llama_{c}"] = _ratio(
                _value(report.stream(LLAMA, c), "ttft_p99"), _value(_best_layout(report, c), "ttft_p99")
            )
    return out


def print_streams_table(report: Report, systems: list[str], concurrencies: tuple[int, ...]) -> None:
    """Every system at each streams concurrency: output tokens/s, ITL p50, TTFT p99 (issue #36's table)."""
    present = [name for name in systems if any(report.stream(name, c) for c in concurrencies)]
    if not present:
        return
    print("\nstreams (256 prompt / 128 output tokens, closed loop): out tok/s, ITL p50 ms, TTFT p99 ms")
    print(f"{'system':<14}" + "".join(f"{f'c={c}':>26}" for c in concurrencies))
    for name in present:
        cells = []
        for c in concurrencies:
            run = report.stream(name, c)
            cells.append(
                "—"
                if run is None
                else f"{_value(run, 'tps'):.1f}, {_ms(_value(run, 'itl_p50'))}, {_ms(_value(run, 'ttft_p99'))}"
            )
        print(f"{name:<14}" + "".join(f"{cell:>26}" for cell in cells))


def headline_line(values: dict[str, float]) -> str:
    return " ".join(f"{key}={value:.2f}" for key, value in values.items())


def print_encryption_cost(report: Report, systems: list[str]) -> None:
    """Served throughput (all requests at once) with CurveZMQ over without, per system; target >= 0.9."""
    for system in systems:
        secure, plain = (
            report.find(system, "mixed", ALL_AT_ONCE),
            report.find(f"{system}-insecure", "mixed", ALL_AT_ONCE),
        )
        ratio = _ratio(
            secure.summary.output_tps if secure else math.nan, plain.summary.output_tps if plain else math.nan
        )
        print(
            f"  encryption cost ({system}): output throughput, all requests at once, CurveZMQ / insecure = "
            f"{ratio:.3f} (target >= 0.90) {'not measured' if math.isnan(ratio) else _verdict(ratio >= 0.9)}"
        )


def write_json(report: Report, path: Path, meta: dict) -> None:
    record = {
        "meta": meta,
        "hf_static_tps": report.hf_tps,
        "hf_static_tps_by_batch": report.hf_by_batch,
        "kv_util": report.kv_util,
        "runs": [
            {
                **asdict(r.summary),
                "output_tps": r.summary.output_tps,
                "system": r.system,
                "workload": r.workload,
                "load": r.load,
                "rate_rps": r.rate_rps,
                "tpots": r.tpots,
            }
            for r in report.runs
        ],
        "procs": [{"system": s, **asdict(p)} for s, p in report.procs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))


def read_json(path: Path) -> Report:
    """The runs and baselines ``write_json`` wrote (to plot a saved run again: ``python -m benchmarks.serve.plots``)."""
    record = json.loads(path.read_text())
    names = {f.name for f in fields(Summary)}
    runs = [
        Run(
            r["system"], r["workload"], r["load"], float(r["rate_rps"]), Summary(**{n: r[n] for n in names}), r["tpots"]
        )
        for r in record["runs"]
    ]
    by_batch = {int(batch): tps for batch, tps in record["hf_static_tps_by_batch"].items()}
    return Report(runs=runs, hf_tps=record["hf_static_tps"], hf_by_batch=by_batch)
