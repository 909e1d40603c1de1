"""The prefill worker across process boundaries: ``python -m prefill_node`` end to end with a SIGTERM
drain, and a decode-side receiver killed with SIGKILL mid-transfer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import yaml

from kvtransfer.shm_pool import SHM_DIR
from protocol.serving import Goodbye, Heartbeat, TokenEvent
from tests.test_prefill_node import BS, CHUNK, Cluster, FakeDecode, FakeGateway, build, model_path, prompt, reference

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_worker_process_serves_a_job_and_drains_on_sigterm(tmp_path):
    import zmq

    ctx = zmq.Context()
    gateway = FakeGateway(ctx)
    config = {
        "model": {"path": model_path(), "dtype": "float32"},
        "engine": {"block_size": BS, "num_kv_blocks": 48, "max_num_batched_tokens": 16, "prefill_chunk_size": CHUNK},
        "gateway": {"worker_heartbeat_s": 0.2},
        "transfer": {"insecure": True},  # the fakes speak plain ZeroMQ; tests/test_hostile_peers.py runs CURVE
        "prefill": {"port": 0, "http_port": 0, "gateway_address": gateway.address, "worker_id": "p-proc"},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefill_node", "--config", str(tmp_path / "p.yaml")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    decode = None
    try:
        ready = proc.stdout.readline().split()
        assert ready and ready[0] == "READY", proc.stderr.read()
        fields = dict(f.split("=", 1) for f in ready[1:])
        hb = gateway.wait(Heartbeat, lambda h: h.worker_id == "p-proc")
        assert hb.address == fields["address"] and hb.role == "prefill" and hb.kv_blocks_in_use == 0
        layout = build().runner.kv_pool.layout  # the same config as the worker's: the same pool layout
        decode = FakeDecode(ctx, layout, fields["address"], "shm")
        tokens = prompt(19, seed=21)
        ref_kv, ref_token = reference(tokens)
        job = decode.job("p1", tokens)
        decode.send(job)
        done = decode.wait_event("p1")
        assert done.ok and done.commit.first_token == ref_token
        assert gateway.wait(TokenEvent, lambda e: e.rid == "p1").token_ids == [ref_token]
        got = decode.kv_tokens(job.dst_block_ids, len(tokens))
        torch.testing.assert_close(got, ref_kv, rtol=0, atol=1e-5)  # another process: its own thread count
        decode.adopt("p1")
        # Idle again: P holds no block for anyone (its full blocks sit in the prefix cache, unreferenced).
        hb = gateway.wait(
            Heartbeat, lambda h: h.kv_blocks_in_use == 0 and h.queued_prefill_tokens == 0 and h.kv_blocks_free == 48
        )
        proc.send_signal(signal.SIGTERM)
        assert gateway.wait(Goodbye, lambda g: g.worker_id == "p-proc")
        assert proc.wait(timeout=20) == 0
        assert list(decode.rx.table.held_blocks()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if decode is not None:
            decode.close()
        gateway.sock.close(linger=0)
        ctx.destroy(linger=0)


RECEIVER = textwrap.dedent("""
    import sys, time, torch, zmq
    from prometheus_client import CollectorRegistry
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqServer
    from kvtransfer.metrics import TransferMetrics
    from kvtransfer.receiver import KVReceiver
    model, dims, dst = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], [int(x) for x in sys.argv[3].split(",")]
    registry = CollectorRegistry()
    server = ZmqServer(zmq.Context(), "127.0.0.1", max_msg_size=64 << 20)
    rx = KVReceiver(KVPool(KVLayout(*dims, torch.float32)), model, server, lambda ids: None,
                    TransferMetrics(registry), credits=1)
    rx.reserve("k1", 1, dst)
    print(server.endpoint, rx.fence_name, flush=True)
    while not registry.get_sample_value("pdserve:kv_handshakes_total", {"result": "accepted"}):
        rx.poll()
        time.sleep(0.001)
    print("HANDSHAKEN", flush=True)  # then silent: P ships one credit's worth of blocks and waits
    time.sleep(600)
""")


def test_receiver_killed_mid_transfer_leaves_nothing_pinned():
    c = Cluster(deadline_s=1.0)
    layout = c.engine.runner.kv_pool.layout
    tokens = prompt(19, seed=22)
    dst = [40, 41, 42, 43, 44]
    dims = f"{layout.num_layers},{layout.num_blocks},{layout.block_size},{layout.kv_heads},{layout.head_dim}"
    from worker.identity import kv_model_name

    rx = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, kv_model_name(model_path()), dims, ",".join(map(str, dst))],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    fence = None
    try:
        endpoint, fence = rx.stdout.readline().split()
        c.start()
        job = c.decode.job("k1", tokens)
        job.kv_address, job.dst_block_ids = endpoint, dst
        c.decode.send(job)
        assert rx.stdout.readline().strip() == "HANDSHAKEN"
        rx.send_signal(signal.SIGKILL)
        rx.wait(timeout=10)
        # The closed connection is noticed at once (a socket monitor); a receiver that vanished without
        # closing it (a host gone) would fail by the 1 s transfer deadline instead.
        failed = c.decode.recv_failed(timeout_ms=15000)
        assert failed.rid == "k1" and "receiver disconnected" in failed.reason
        # P is back to idle: its second heartbeat from now on (the first may have left before the
        # failure) shows nothing in use, running or queued.
        c.gateway.records.clear()
        while c.gateway.sock.poll(0):
            c.gateway.sock.recv_multipart()
        c.gateway.wait(Heartbeat)
        hb = c.gateway.wait(Heartbeat, lambda h: h is not c.gateway.records[0])
        assert (hb.kv_blocks_in_use, hb.num_running, hb.num_waiting, hb.queued_prefill_tokens) == (0, 0, 0, 0)
        c.stop()
        with c.decode.lock:
            c.decode.rx.abort("k1")  # the test's own (unused) reservation for this rid
        assert c.sample("pdserve:prefill_jobs_rejected_total", reason="transfer") == 1
        c.assert_idle_no_leak()
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
        if fence:
            Path(SHM_DIR, fence).unlink(missing_ok=True)  # SIGKILL left the receiver's fence behind
        c.close()
