"""Soak: sustained concurrent streaming completions against ``pdserve serve``, checked for errors,
latency drift, memory growth and file-descriptor growth.

    python -m tests.soak [--minutes M] [--concurrency C] [--json docs/soak.json]

or ``run_soak(minutes, concurrency) -> SoakResult`` (``tests/test_soak.py`` runs 2 minutes in CI).

Topology: the ``tiny`` llama, **1 prefill + 1 decode worker**: the CI machine has 2 cores, and one of
each already crosses every hop a request can take (gateway -> D -> P -> KV transfer over shm -> D ->
gateway). Every uncached prompt goes through the prefill worker (``local_prefill_max_tokens: 0``) and
the KV pool is small (``num_kv_blocks``), so the prefix caches fill and evict all run long.

The load: C streams in a closed loop (a new request as soon as one ends), alternating between
- *checked* requests: a fixed pool of greedy prompts of varied length, whose streamed text must equal
  ``engine.llm.LLM``'s output for the same prompt (repeats also exercise the prefix caches), and
- *fresh* requests: new random prompts (4-200 tokens, 1-64 output tokens), checked for their count.

Life of a run:
1. warm-up: the same load for ``warmup_s``, measured for errors only; then the load stops, the
   clients' connections close and the cluster goes idle;
2. baseline: RSS (VmRSS of /proc/<pid>/status) and open fds (/proc/<pid>/fd) of the gateway and
   every worker, read idle, so that the start and end readings see the same state;
3. the soak: C streams for M minutes; each request's latency (send to last token) is kept;
4. the end: the load stops, ``ServeProcess.wait_idle`` (every worker has kv_blocks_in_use == 0 and
   passed its idle integrity check), and RSS and fds are read again.

Verdict "pass" when all hold: no error; last-quarter p99 <= P99_RATIO_MAX x first-quarter p99 (by
send time); RSS grew < 10% in every process; no process has more fds at the end than at baseline; no
process was restarted; the workers ended idle with integrity intact.

JSON keys (``--json``; ``docs/soak.json``):
    date (UTC ISO 8601), machine (str), command (str), topology (str), minutes, warmup_s, concurrency,
    requests (int, soak phase), checked_requests (of them, compared with the reference), errors (int,
    warm-up and soak), error_samples (up to 5 strings), latency_p99_s {"first_quarter", "last_quarter",
    "ratio"}, latency_p50_s {"first_quarter", "last_quarter"}, rss_kb {process: {"start", "end",
    "growth"}}, fds {process: {"start", "end"}}, idle_ok (bool), load_average {"start", "end"} (the
    machine's 1-minute load average, to tell a noisy neighbour from drift), failures (list of strings,
    empty when passing), verdict ("pass" | "fail"). Processes: "gateway", "prefill-0", "decode-0".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.common.client import Target, send_one
from benchmarks.common.metrics import RequestTimeline, percentile
from benchmarks.common.workload import BenchRequest
from benchmarks.serve.workloads import Scheduled
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
VOCAB = 768  # the tiny model's vocabulary
FIRST_ID = 5  # ids below are special tokens (pad, bos, eos, chat markers)
NUM_CHECKED = 24  # the pool of greedy prompts with a reference output
PROMPT_LENS, OUTPUT_LENS = (4, 200), (1, 64)
# The bound. RSS also counts what glibc keeps after free (fragmented heaps): a leak-free
# gateway still creeps by a few hundred kB while its live heap stays flat, which 10% leaves room for.
RSS_GROWTH_MAX = 0.10
# A stationary load on a healthy server keeps its p99 put; what the soak hunts (a queue that never
# drains, a leak that slows every step, a structure scanned per request that grows) compounds over
# minutes into a steady climb. A quarter's p99 rests on its few slowest requests, and on a shared
# 2-core machine the OS scheduler alone moves it by a few tens of percent between quarters, so the
# bound is 1.5x: above the noise, well below what a real drift reaches.
P99_RATIO_MAX = 1.5
FD_SETTLE_S = 5.0  # a closed client connection's server-side socket may take a moment to be closed


@dataclass(slots=True)
class SoakResult:
    minutes: float
    warmup_s: float
    concurrency: int
    topology: str
    requests: int = 0
    checked_requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latency_p99_s: dict[str, float] = field(default_factory=dict)
    latency_p50_s: dict[str, float] = field(default_factory=dict)
    rss_kb: dict[str, dict[str, float]] = field(default_factory=dict)
    fds: dict[str, dict[str, int]] = field(default_factory=dict)
    idle_ok: bool = False
    load_average: dict[str, float] = field(default_factory=dict)  # 1-minute, at baseline and end: others' load
    failures: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "fail" if self.failures else "pass"


class RequestMix:
    """Checked and fresh requests in turn; each gets a unique index, and the expected text when checked."""

    def __init__(self, reference: LLM, seed: int = 0):
        self.rng = random.Random(seed)
        self.count = 0
        prompts = [self._prompt() for _ in range(NUM_CHECKED)]
        outputs = [self.rng.randint(*OUTPUT_LENS) for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        done = reference.generate(prompts, params)
        # The server's text leaves special tokens out (skip_special_tokens defaults to true, as in vLLM).
        texts = [reference.tokenizer.decode(d.outputs[0].token_ids, skip_special_tokens=True) for d in done]
        self.pool = list(zip(prompts, outputs, texts))

    def _prompt(self) -> tuple[int, ...]:
        return tuple(self.rng.randrange(FIRST_ID, VOCAB) for _ in range(self.rng.randint(*PROMPT_LENS)))

    def next(self) -> tuple[BenchRequest, str | None]:
        self.count += 1
        if self.count % 2:
            prompt, output_len, expected = self.pool[(self.count // 2) % NUM_CHECKED]
            return BenchRequest(self.count, prompt, output_len), expected
        return BenchRequest(self.count, self._prompt(), self.rng.randint(*OUTPUT_LENS)), None


Outcome = tuple[RequestTimeline, bool]  # a request's timeline, and whether its text was checked


async def drive(target: Target, mix: RequestMix, concurrency: int, duration_s: float) -> list[Outcome]:
    """``concurrency`` streams for ``duration_s`` (no request sent after it; those in flight finish).
    Returns (timeline, was checked) per request; a checked text that differs becomes the error."""
    done: list[Outcome] = []
    stop_at = time.perf_counter() + duration_s

    async def stream(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            request, expected = mix.next()
            t = await send_one(client, target, Scheduled(0.0, request, "soak"))
            if expected is not None and not t.error and t.text != expected:
                t.error = f"request {request.index}: text {t.text[:60]!r} != reference {expected[:60]!r}"
            done.append((t, expected is not None))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        await asyncio.gather(*(stream(client) for _ in range(concurrency)))
    return done  # the client is closed: its connections to the gateway are gone before any fd reading


def cluster_pids(serve: ServeProcess) -> dict[str, int]:
    """The gateway (the supervisor's child running ``-m gateway``) and every worker, by name."""
    pids = dict(serve.worker_pid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
        if parent == serve.proc.pid and b"gateway" in cmdline:
            pids["gateway"] = int(entry)
    assert "gateway" in pids, "gateway process not found among the supervisor's children"
    return pids


def rss_kb(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1])


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pids: dict[str, int], baseline: dict[str, int] | None) -> dict[str, int]:
    """Open fds per process; with a baseline, re-read for up to FD_SETTLE_S while any count is above
    it, so that a socket the client closed a moment ago is not taken for a leak (a real leak stays)."""
    give_up = time.monotonic() + FD_SETTLE_S
    counts = {name: fd_count(pid) for name, pid in pids.items()}
    while baseline and any(counts[n] > baseline[n] for n in counts) and time.monotonic() < give_up:
        time.sleep(0.25)
        counts = {name: fd_count(pid) for name, pid in pids.items()}
    return counts


def quarter_latencies(timelines: list[RequestTimeline], start: float, duration_s: float) -> tuple[list, list]:
    """End-to-end latencies of the successful requests sent in the first and in the last quarter."""
    ok = [t for t in timelines if t.ok]
    first = [t.e2e for t in ok if t.send_s - start < duration_s / 4]
    last = [t.e2e for t in ok if t.send_s - start >= 3 * duration_s / 4]
    return first, last


def judge(result: SoakResult, pids_start: dict[str, int], pids_end: dict[str, int]) -> None:
    if result.errors:
        result.failures.append(f"{result.errors} requests failed, e.g. {result.error_samples[:1]}")
    if not result.latency_p99_s["ratio"] <= P99_RATIO_MAX:
        result.failures.append(f"p99 last/first quarter = {result.latency_p99_s['ratio']:.2f} > {P99_RATIO_MAX}")
    for name, rss in result.rss_kb.items():
        if rss["growth"] >= RSS_GROWTH_MAX:
            result.failures.append(f"{name}: RSS grew {rss['growth']:.1%} ({rss['start']} -> {rss['end']} kB)")
    for name, fds in result.fds.items():
        if fds["end"] > fds["start"]:
            result.failures.append(f"{name}: open fds {fds['start']} -> {fds['end']}")
    if pids_end != pids_start:
        result.failures.append(f"a process was restarted: {pids_start} -> {pids_end}")
    if not result.idle_ok:
        result.failures.append("workers not idle with integrity intact at the end")


def run_soak(minutes: float = 2.0, concurrency: int = 8, warmup_s: float = 20.0, log=None) -> SoakResult:
    log = log or (lambda line: print(line, file=sys.stderr))
    model = tiny_model_dir("llama")
    mix = RequestMix(LLM(str(model), block_size=BLOCK))
    result = SoakResult(minutes, warmup_s, concurrency, topology="1 prefill + 1 decode")
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        serve = ServeProcess(
            model,
            Path(tmp),
            engine={"block_size": BLOCK, "num_kv_blocks": 256},
            gateway={"local_prefill_max_tokens": 0},
        )
        try:
            target = Target(serve.url, str(model))
            log(f"soak: warm-up {warmup_s:.0f} s, {concurrency} streams")
            warm = asyncio.run(drive(target, mix, concurrency, warmup_s))
            serve.wait_idle()
            pids = cluster_pids(serve)
            rss_start = {name: rss_kb(pid) for name, pid in pids.items()}
            fds_start = settled_fds(pids, None)
            result.load_average["start"] = os.getloadavg()[0]
            log(f"soak: {minutes:g} min; baseline RSS kB {rss_start}, fds {fds_start}")
            start = time.perf_counter()
            soak = asyncio.run(drive(target, mix, concurrency, minutes * 60))
            result.load_average["end"] = os.getloadavg()[0]
            result.idle_ok = _idle(serve)
            pids_end = cluster_pids(serve)
            rss_end = {name: rss_kb(pid) for name, pid in pids.items()}
            fds_end = settled_fds(pids, fds_start)
        finally:
            serve.stop()
    failed = [t.error for t, _ in warm + soak if t.error]
    result.requests, result.checked_requests = len(soak), sum(checked for _, checked in soak)
    result.errors, result.error_samples = len(failed), failed[:5]
    first, last = quarter_latencies([t for t, _ in soak], start, minutes * 60)
    p99 = {"first_quarter": percentile(first, 99), "last_quarter": percentile(last, 99)}
    result.latency_p99_s = {**p99, "ratio": p99["last_quarter"] / p99["first_quarter"]}
    result.latency_p50_s = {"first_quarter": percentile(first, 50), "last_quarter": percentile(last, 50)}
    result.rss_kb = {
        n: {"start": rss_start[n], "end": rss_end[n], "growth": rss_end[n] / rss_start[n] - 1} for n in pids
    }
    result.fds = {n: {"start": fds_start[n], "end": fds_end[n]} for n in pids}
    judge(result, pids, pids_end)
    return result


def _idle(serve: ServeProcess) -> bool:
    try:
        serve.wait_idle(timeout_s=60)
        return True
    except AssertionError:
        return False


def report(result: SoakResult, command: str) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem_kb = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal:")))
    machine = f"{os.cpu_count()} cores of {cpu}, {mem_kb >> 20} GiB, {platform.platform()}, no GPU used"
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "command": command,
        **asdict(result),
        "verdict": result.verdict,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="length of the measured soak (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="streams in flight (default 8)")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="load before the baseline (default 20)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = run_soak(args.minutes, args.concurrency, args.warmup_s)
    data = report(result, "python -m tests.soak " + " ".join(argv))
    print(json.dumps(data, indent=2))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if result.verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
