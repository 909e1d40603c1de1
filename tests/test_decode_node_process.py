"""A real ``python -m decode_node`` process against a fake gateway: greedy output equals the
single-process engine's, and SIGTERM drains (in-flight request finishes, Goodbye, exit 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import zmq

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from protocol.serving import Goodbye
from tests.decode_harness import FakeGateway, decode_config, generate, scrape, tokens_of

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]


def test_process_serves_then_drains_on_sigterm():
    ctx = zmq.Context()
    gateway = FakeGateway(ctx)
    config = decode_config(gateway.address)
    sets = [
        f"--set={k}={v}"
        for k, v in {
            "model.path": config.model.path,
            "model.max_model_len": 256,
            "engine.block_size": 4,
            "engine.num_kv_blocks": 32,
            "engine.num_threads": 1,
            "decode.gateway_address": gateway.address,
            "decode.kv_port": 0,
            "decode.http_port": 0,
            "decode.worker_id": "dp",
            "gateway.worker_heartbeat_s": 0.2,
            "decode.drain_timeout_s": 30,
            "transfer.insecure": "true",
        }.items()
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "decode_node", *sets],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY "), ready
        http_port = int(dict(kv.split("=", 1) for kv in ready.split()[1:])["http_port"])
        gateway.wait_heartbeat(lambda hb: hb.worker_id == "dp" and not hb.draining)
        assert scrape(http_port, "pdserve:kv_blocks_total") == 32
        params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
        expected = LLM(config.model.path, config=config).generate([PROMPT], SamplingParams(**params))[0]

        gateway.send("dp", generate("r1", PROMPT, **params))
        assert tokens_of(gateway.collect("r1")[0]) == expected.outputs[0].token_ids

        gateway.send("dp", generate("r2", PROMPT, max_tokens=60, temperature=0.0, ignore_eos=True))
        first = gateway.recv(until=lambda r: getattr(r, "rid", "") == "r2")  # in flight
        proc.send_signal(signal.SIGTERM)
        events = [first, *gateway.collect("r2")[0]]  # finishes despite the drain
        assert events[-1].finish_reason == "length" and len(tokens_of(events)) == 60
        assert gateway.recv(until=lambda r: isinstance(r, Goodbye)) == Goodbye("dp")
        assert any(hb.draining for hb in gateway.heartbeats)
        last = gateway.heartbeats[-1]  # sent just before the Goodbye
        assert (last.draining, last.kv_blocks_in_use, last.num_running) == (True, 0, 0)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
