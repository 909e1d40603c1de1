"""The longest silence between a decode worker's heartbeats while it prefills one long prompt in a single
step: with the loop's own heartbeats only (how workers heartbeated before worker/liveness.py: between
steps) and with the liveness thread, alternated in one run, on the same machine and model.

    python -m benchmarks.engine.heartbeat_gap [--format q8_0] [--tokens 2048] [--runs 2] [--threads 2]

A decode worker of this process (SmolLM2-135M in the GGUF format asked, the C kernels) prefills its own
prompt, as a colocated decode worker does; the step budget and chunk are the prompt's length, so the
prompt is one step. A ROUTER socket plays the gateway and notes when each heartbeat arrives. Reported per
run: the step's seconds (the request's arrival to its first token), the longest gap between heartbeats
around it, and how that gap compares with the gateway's default ``worker_timeout_s`` (15 s), past which
a gateway drops a silent worker. The heartbeat interval is the served benchmarks' (0.5 s).
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from dataclasses import dataclass

import zmq

from benchmarks.peers.gguf_variants import gguf_file
from configs.loader import load_config
from decode_node.node import DecodeNode
from protocol.codec import decode, encode
from protocol.serving import Generate, Heartbeat, SamplingSpec, TokenEvent, TokenEvents
from protocol.zmq_util import bind, make_socket

HEARTBEAT_S = 0.5  # benchmarks/common/launcher.py's gateway.worker_heartbeat_s
WORKER_TIMEOUT_S = 15.0  # configs/schema.py gateway.worker_timeout_s


@dataclass(slots=True)
class Run:
    system: str  # "loop only" or "liveness thread"
    step_s: float  # the prompt's arrival to its first token
    max_gap_s: float  # the longest time between two heartbeats from before the request to after it


def prompt_of(tokens: int) -> list[int]:
    return [100 + (i * 7919) % 40000 for i in range(tokens)]


def cpu_name() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def one_run(model: str, tokens: int, threads: int, with_thread: bool) -> Run:
    ctx = zmq.Context()
    gateway = make_socket(ctx, zmq.ROUTER)
    address = bind(gateway, "127.0.0.1", 0)
    config = load_config(
        None,
        env={},
        overrides={
            "model.path": model,
            "model.max_model_len": tokens + 64,
            "engine.max_num_batched_tokens": tokens,
            "engine.prefill_chunk_size": tokens,  # the pacer's first budget: the whole prompt in one step
            "engine.num_threads": threads,
            "decode.gateway_address": address,
            "decode.kv_port": 0,
            "decode.http_port": 0,
            "decode.worker_id": "d0",
            "gateway.worker_heartbeat_s": HEARTBEAT_S,
            "transfer.insecure": True,
        },
    )
    node = DecodeNode.start(config, ctx)
    liveness = node.server.liveness
    if not with_thread:  # the loop's heartbeats only: the first one, then one between steps when due
        liveness.start = liveness.send
    loop = threading.Thread(target=node.server.run, daemon=True)
    loop.start()
    heartbeats: list[float] = []

    def answer(rid: str, prompt: list[int]) -> float:
        """Send a request; the seconds to its first token, heartbeat arrivals noted meanwhile."""
        sent = time.monotonic()
        spec = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True)
        gateway.send_multipart([b"d0", encode(Generate(rid, prompt, spec, "", time.time() + 600))])
        while True:
            _, frame = gateway.recv_multipart()
            record = decode(frame, 16 << 20)
            if isinstance(record, Heartbeat):
                heartbeats.append(time.monotonic())
                continue
            events = record.events if isinstance(record, TokenEvents) else [record]
            if any(isinstance(e, TokenEvent) and e.rid == rid for e in events):
                assert not events[0].error, events[0].error
                return time.monotonic() - sent

    try:
        answer("warm", prompt_of(16))  # one-time costs (forms, first calls) out of the measured step
        heartbeats.clear()
        started = time.monotonic()
        step_s = answer("long", prompt_of(tokens))
        ended = time.monotonic()
        while gateway.poll(int(3 * HEARTBEAT_S * 1000)):  # the first heartbeats after the step
            _, frame = gateway.recv_multipart()
            if isinstance(decode(frame, 16 << 20), Heartbeat):
                heartbeats.append(time.monotonic())
                if heartbeats[-1] > ended + HEARTBEAT_S:
                    break
        times = [started, *heartbeats]
        max_gap = max(b - a for a, b in zip(times, times[1:]))
    finally:
        node.server.stop()
        loop.join(timeout=60)
        node.close()
        gateway.close(linger=0)
        ctx.destroy(linger=0)
    return Run("liveness thread" if with_thread else "loop only", step_s, max_gap)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="q8_0", help="SmolLM2 GGUF format (benchmarks/peers/gguf_variants.py)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens, prefilled in one step")
    parser.add_argument("--runs", type=int, default=2, help="runs of each system, alternated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    model = str(gguf_file(args.format))
    runs = [
        one_run(model, args.tokens, args.threads, with_thread)
        for _ in range(args.runs)
        for with_thread in (False, True)
    ]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"SmolLM2-135M {args.format}, a {args.tokens}-token prompt in one step, heartbeats every {HEARTBEAT_S} s")
    print("| system | step (s) | longest heartbeat gap (s) | gap / worker_timeout_s (15 s) |")
    print("|---|---|---|---|")
    for run in runs:
        print(f"| {run.system} | {run.step_s:.2f} | {run.max_gap_s:.2f} | {run.max_gap_s / WORKER_TIMEOUT_S:.2f} |")


if __name__ == "__main__":
    main()
