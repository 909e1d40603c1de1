"""Served throughput with 1 and 2 gateways in front of the same workers, side by side in one run:
``python -m benchmarks.serve.gateway_replicas [--concurrency 16 64 128] [--seconds 20]``.

The workload makes the gateway the bottleneck: short text prompts (tokenized by the gateway), short
greedy outputs (8 tokens, each detokenized and sent as an SSE chunk), many concurrent streams, and a
model so small (tests/model_factory.py's 2-layer llama) that the decode worker's steps cost little.
Each system is ``pdserve serve --prefill 0 --decode 1 --gateways N``, all started (and warmed) before
the first point; a closed-loop client keeps ``concurrency`` streams open, spread evenly over the
gateways, for ``seconds`` per point, each concurrency on every system in turn, so that the systems see
the same background load of a shared machine.

Reported per point: completed requests/s, output tokens/s, p50/p99 latency, CPU-milliseconds per
request of the gateways and of the decode worker (what a request costs each side, which a busy shared
machine disturbs less than throughput), and the CPU each process used over the point
(``benchmarks/common/procs.py``; 100% = one core busy), this client's included.
The client is a minimal asyncio HTTP/1.1 keep-alive client on raw sockets, so as little CPU as possible
goes to measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.launcher import ServedSystem
from benchmarks.common.procs import sample_tree

PROMPTS = [
    "Tell me about foxes.",
    "What is a wolf?",
    "Name a river.",
    "Count to three.",
    "Say hello.",
    "Why is the sky blue?",
    "A short poem:",
    "Define entropy.",
]
MAX_TOKENS = 8


@dataclass(slots=True)
class Point:
    gateways: int
    concurrency: int
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_percent: dict[str, float]  # process name -> CPU over the point (100 = one core)
    gateway_cpu_ms_per_request: float  # every gateway's CPU over the point / requests completed
    decode_cpu_ms_per_request: float  # the decode worker's, likewise: what a request costs each side


async def stream_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> int:
    """One streamed completion on a kept-alive connection; returns the output tokens (from usage)."""
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(status.decode(errors="replace").strip())
    while (await reader.readline()) not in (b"\r\n", b""):  # headers (chunked transfer encoding)
        pass
    tokens = 0
    while True:  # chunks: size line, data, CRLF; a 0-size chunk ends the response
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return tokens
        data = await reader.readexactly(size + 2)
        if b'"usage"' in data and b'"completion_tokens"' in data:
            tokens = json.loads(data[data.index(b"{") : data.rindex(b"}") + 1])["usage"]["completion_tokens"]


async def client_loop(
    url: str, model: str, index: int, stop_at: float, latencies: list[float], tokens: list[int], errors: list[str]
) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    n = index
    try:
        while time.perf_counter() < stop_at:
            body = json.dumps(
                {
                    "model": model,
                    "prompt": PROMPTS[n % len(PROMPTS)],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            n += 1
            sent = time.perf_counter()
            try:
                tokens.append(await stream_one(reader, writer, body))
                latencies.append(time.perf_counter() - sent)
            except (RuntimeError, ValueError, ConnectionError, asyncio.IncompleteReadError) as e:
                errors.append(str(e)[:200])
                writer.close()
                await asyncio.sleep(0.05)
                reader, writer = await asyncio.open_connection(host, int(port))
    finally:
        writer.close()


async def run_point(
    system: ServedSystem, concurrency: int, seconds: float
) -> tuple[list[float], list[int], list[str], float]:
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(
        *(
            client_loop(system.urls[i % len(system.urls)], system.model, i, stop_at, latencies, tokens, errors)
            for i in range(concurrency)
        )
    )
    return latencies, tokens, errors, time.perf_counter() - start


def measure(system: ServedSystem, gateways: int, concurrency: int, seconds: float) -> Point:
    before, client_before = sample_tree(system.proc.pid), time.process_time()
    latencies, tokens, errors, elapsed = asyncio.run(run_point(system, concurrency, seconds))
    after = sample_tree(system.proc.pid)
    cpu = {"client": round(100.0 * (time.process_time() - client_before) / elapsed, 1)}
    for pid, sample in after.items():
        if pid in before and pid != system.proc.pid:
            name = sample.name if sample.name != "gateway" else f"gateway:{pid}"
            cpu[name] = round(100.0 * (sample.cpu_s - before[pid].cpu_s) / elapsed, 1)
    ordered = sorted(latencies)

    def ms_per_request(prefix: str) -> float:
        busy = sum(value for name, value in cpu.items() if name.startswith(prefix)) / 100 * elapsed
        return round(1000 * busy / max(len(latencies), 1), 2)

    return Point(
        gateways,
        concurrency,
        round(elapsed, 1),
        len(latencies),
        len(errors),
        round(len(latencies) / elapsed, 1),
        round(sum(tokens) / elapsed, 1),
        round(1000 * statistics.median(ordered), 1) if ordered else 0.0,
        round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else 0.0,
        cpu,
        ms_per_request("gateway"),
        ms_per_request("decode"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve.gateway_replicas", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--seconds", type=float, default=20.0, help="per point")
    p.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", type=Path, help="JSON of every point")
    args = p.parse_args(argv)
    from tests.model_factory import tiny_model_dir  # the 2-layer model: the workers cost little

    model = tiny_model_dir("llama")
    cpus = os.sched_getaffinity(0)
    points: list[Point] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as running:
        systems = {}
        for gateways in args.gateways:  # all started up front; an idle one costs next to nothing
            system = ServedSystem(
                f"gateways-{gateways}",
                model,
                Path(tmp),
                cpus,
                0,
                1,
                {"engine": {"block_size": 16, "num_kv_blocks": 2048}, "gateway": {"max_queued_requests": 1024}},
                num_gateways=gateways,
            )
            running.callback(system.stop)
            asyncio.run(run_point(system, 16, 5.0))  # warm: the first requests pay for lazy imports
            systems[gateways] = system
        for concurrency in args.concurrency:  # each concurrency on every system in turn: same load around
            for gateways, system in systems.items():
                system.wait_idle()
                point = measure(system, gateways, concurrency, args.seconds)
                points.append(point)
                print(json.dumps(asdict(point)), flush=True)
    print(f"\n{len(cpus)} CPU(s) available to the run (shared with everything else on this host)")
    print(
        f"{'gateways':>8} {'streams':>7} {'req/s':>7} {'tok/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
        f"{'gw ms/req':>9} {'D ms/req':>8}  CPU % per process"
    )
    for pt in points:
        cpu = ", ".join(f"{name} {value:.0f}" for name, value in sorted(pt.cpu_percent.items()))
        print(
            f"{pt.gateways:>8} {pt.concurrency:>7} {pt.requests_per_s:>7.1f} {pt.tokens_per_s:>7.1f} "
            f"{pt.p50_ms:>7.0f} {pt.p99_ms:>7.0f} {pt.errors:>6} {pt.gateway_cpu_ms_per_request:>9.2f} "
            f"{pt.decode_cpu_ms_per_request:>8.2f}  {cpu}"
        )
    gateway_ms = [pt.gateway_cpu_ms_per_request for pt in points if pt.gateways == 1 and pt.requests]
    if gateway_ms:  # one event loop is one core: where a lone gateway runs out, whatever the workers do
        print(
            f"one gateway saturates one core at ~{1000 / statistics.median(gateway_ms):.0f} requests/s "
            f"(median {statistics.median(gateway_ms):.2f} CPU-ms per request)"
        )
    if args.out:
        args.out.write_text(json.dumps([asdict(pt) for pt in points], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
