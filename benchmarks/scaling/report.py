"""The scaling benchmark's record of each measured point, its markdown table, its JSON and the header
line that names the machine."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.metrics import Summary
from benchmarks.scaling.plan import CONCURRENCY

HF = "hf"  # transformers static batching: offline, so its latencies are derived (HF_NOTE)
HF_NOTE = (
    "hf: transformers static batching, batch = concurrency, offline: each request counted as sent when "
    "its batch started, TTFT = its batch's first step, ITL = the gaps between the batch's steps"
)


@dataclass(slots=True, frozen=True)
class Point:
    system: str  # disagg, coloc, llama or hf
    axis: str  # CONCURRENCY or PROMPT_LEN (scaling_plan)
    concurrency: int
    prompt_len: int
    output_len: int
    summary: Summary

    @property
    def x(self) -> int:
        return self.concurrency if self.axis == CONCURRENCY else self.prompt_len


def _ms(seconds: float, digits: int = 0) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.{digits}f}"


TABLE_HEADER = (
    "| system | sweep | concurrency | prompt | output | ok | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
    "| ITL p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(p: Point) -> str:
    s = p.summary
    return (
        f"| {p.system} | {p.axis} | {p.concurrency} | {p.prompt_len} | {p.output_len} | {s.num_ok}/{s.num_requests} "
        f"| {s.output_tps:.1f} | {_ms(s.ttft['p50'])} | {_ms(s.ttft['p99'])} | {_ms(s.itl['p50'], 1)} "
        f"| {_ms(s.itl['p99'], 1)} |"
    )


def table(points: list[Point]) -> str:
    """Every point, one markdown row each, in the order measured; a note under it when hf is among them."""
    lines = [TABLE_HEADER, *(table_row(p) for p in points)]
    if any(p.system == HF for p in points):
        lines.append(f"\n({HF_NOTE})")
    return "\n".join(lines)


def cpu_model(cpuinfo_text: str) -> str:
    """The first ``model name`` of /proc/cpuinfo's text, else platform's processor or machine."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def machine_line(cpuinfo_text: str, cpus: list[int], online: int, when: str) -> str:
    return f"{cpu_model(cpuinfo_text)} ({platform.machine()}), {len(cpus)} cores {cpus} of {online} online, {when}"


def write_json(points: list[Point], path: Path, meta: dict) -> None:
    record = {
        "meta": meta,
        "points": [
            {
                "system": p.system,
                "axis": p.axis,
                "concurrency": p.concurrency,
                "prompt_len": p.prompt_len,
                "output_len": p.output_len,
                "output_tps": p.summary.output_tps,
                **asdict(p.summary),
            }
            for p in points
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
