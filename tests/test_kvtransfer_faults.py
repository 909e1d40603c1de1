"""Fault tests with real processes (SIGKILL) and hostile frames; the survivor must clean up."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import torch
import zmq
from prometheus_client import CollectorRegistry

from engine.kv.pool import KVPool
from kvtransfer.channel import ZmqClient
from kvtransfer.events import TransferStatus
from kvtransfer.metrics import TransferMetrics
from kvtransfer.sender import KVSender
from kvtransfer.shm_pool import SharedTensor
from protocol.codec import encode
from protocol.kv_messages import BlockWrite, Credit, Handshake, KVCompat
from tests.test_kvtransfer_transports import LAYOUT, Node, pump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SENDER_SCRIPT = textwrap.dedent("""
    import sys, time, torch, zmq
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqClient
    from kvtransfer.sender import KVSender
    layout = KVLayout(2, 16, 4, 2, 8, torch.float32)
    tx = KVSender(KVPool(layout, tensor=torch.ones(layout.shape)), "tiny", ZmqClient(zmq.Context(), sys.argv[1]))
    tx.handshake()
    print("ready", flush=True)
    sys.stdin.readline()  # the receiver reserves the range meanwhile
    tx.send("r", 1, [0, 1], [4, 5])  # half of the range; never commits
    while tx.pinned_blocks():
        tx.poll()
    print("sent", flush=True)
    time.sleep(60)
""")

RECEIVER_SCRIPT = textwrap.dedent("""
    import torch, zmq
    from prometheus_client import CollectorRegistry
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqServer
    from kvtransfer.metrics import TransferMetrics
    from kvtransfer.receiver import KVReceiver
    layout = KVLayout(2, 16, 4, 2, 8, torch.float32)
    server = ZmqServer(zmq.Context(), "127.0.0.1", max_msg_size=1 << 22)
    rx = KVReceiver(KVPool(layout), "tiny", server, lambda ids: None, TransferMetrics(CollectorRegistry()), credits=2)
    rx.reserve("r", 1, list(range(8, 16)))
    print(server.endpoint, rx.fence_name, flush=True)
    while True:
        rx.poll()
""")


def _spawn(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
    )


def _poll_until_line(node: Node, proc: subprocess.Popen) -> str:
    give_up = time.monotonic() + 30  # the child imports torch first
    while not _line_ready(proc):
        node.rx.poll()  # answers the child's handshake and applies its writes
        assert time.monotonic() < give_up and proc.poll() is None, "sender child never got going"
    return proc.stdout.readline().strip()


def _line_ready(proc: subprocess.Popen) -> bool:
    return bool(select.select([proc.stdout], [], [], 0)[0])


def test_sender_killed_mid_transfer_receiver_reclaims_within_lease():
    node = Node("zmq", lease_s=1.0)
    proc = _spawn(SENDER_SCRIPT, node.server.endpoint)
    try:
        assert _poll_until_line(node, proc) == "ready"
        node.reserve("r", 1, [4, 5, 6, 7])
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert _poll_until_line(node, proc) == "sent"
        assert node.rx.table.get("r").written == {4, 5}
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        events = []
        while not events:
            events = node.rx.poll()
            assert time.monotonic() - killed_at < 1.0 + 1.0, "no failure reported within the lease"
        assert [(e.rid, e.ok, e.reason) for e in events] == [("r", False, "lease expired")]
        assert node.free == set(range(16)) and node.rx.table.held_blocks() == {}
        assert node.sample("pdserve:kv_lease_expired_total") == 1
        assert node.sample("pdserve:kv_transfer_failures_total", side="receiver", reason="lease expired") == 1
    finally:
        proc.kill()
        proc.wait()
        node.close()


def test_receiver_killed_sender_pins_nothing_after_deadline():
    proc = _spawn(RECEIVER_SCRIPT)
    ctx, fence_name, registry = zmq.Context(), "", CollectorRegistry()
    try:
        endpoint, fence_name = proc.stdout.readline().split()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        unpinned = []
        src = KVPool(LAYOUT, tensor=torch.randn(LAYOUT.shape))
        tx = KVSender(
            src,
            "tiny",
            ZmqClient(ctx, endpoint),
            deadline_s=0.5,
            unpin=unpinned.extend,
            metrics=TransferMetrics(registry),
        )
        tx.handshake(timeout_s=30)
        tx.send("r", 1, list(range(8)), list(range(8, 16)))
        while tx.status("r") is not TransferStatus.TRANSFERRING:
            tx.poll()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert tx.pinned_blocks(), "blocks are pinned while the transfer is alive"
        killed_at = time.monotonic()
        events = []
        while not events:
            events = tx.poll()
            assert time.monotonic() - killed_at < 0.5 + 1.0, "sender still waiting past its deadline"
        assert [(e.rid, e.ok, e.reason) for e in events] == [("r", False, "receiver silent past deadline")]
        assert tx.pinned_blocks() == [] and sorted(unpinned) == list(range(8))
        assert (
            registry.get_sample_value(
                "pdserve:kv_transfer_failures_total", {"side": "sender", "reason": "receiver silent past deadline"}
            )
            == 1
        )
    finally:
        if fence_name:  # the killed receiver could not clean up its shared memory
            SharedTensor(fence_name, torch.empty(0), is_owner=True).unlink()
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)


def test_malformed_oversized_and_wrong_typed_frames_counted_while_serving():
    node = Node("zmq")
    try:
        raw = node.ctx.socket(zmq.DEALER)
        raw.connect(node.server.endpoint)
        compat = KVCompat(1, "tiny", "float32", 2, 2, 8, 4)
        wrong_type = msgpack.packb(
            [
                "kv.handshake",
                {
                    "compat": ["kv.compat", {}],
                    "sender_incarnation": 5,
                    "hostname": "h",
                    "transports": [],
                    "cuda_device": None,
                },
            ]
        )
        hostile = [
            [b"\x00garbage"],  # not msgpack
            [msgpack.packb(["kv.no_such_record", {}])],  # unknown tag
            [wrong_type],  # wrong field types
            [msgpack.packb(["kv.abort", {"rid": "r"}])],  # missing fields
            [b"\x92" + b"\xa1x" * 70000],  # header over the 64 KiB limit (under MAXMSGSIZE)
            [encode(Handshake(compat, "i", "h", ["zmq"])), b"extra frame"],  # wrong frame count
            [],  # nothing at all
            [encode(Credit("r", 1, 5))],  # a receiver's message, sent to the receiver
        ]
        for frames in hostile:
            raw.send_multipart(frames if frames else [b"", *frames])
        # a write with no handshake behind it: decodes, but comes from an unknown incarnation
        raw.send_multipart([encode(BlockWrite("r", 1, "nobody", [1], True, 4)), b"abcd"])
        # beyond MAXMSGSIZE: zmq itself drops this peer before our code sees a byte
        huge = node.ctx.socket(zmq.DEALER)
        huge.connect(node.server.endpoint)
        huge.send_multipart([b"x" * ((1 << 22) + 1)])
        time.sleep(0.2)
        for _ in range(50):
            node.rx.poll()
        assert node.sample("pdserve:kv_malformed_frames_total") == len(hostile)
        assert node.sample("pdserve:kv_rejected_writes_total", reason="unknown_incarnation") == 1
        # ... and the receiver still serves a real sender, bit-exact
        tx = node.sender()
        node.reserve("ok", 1, [1, 2])
        tx.send("ok", 1, [3, 4], [1, 2])
        tx.commit("ok", 1)
        rx_events, _ = pump(node, tx, until=lambda rx, t: rx and t)
        assert rx_events[0].ok and torch.equal(node.rx.pool.tensor[:, :, [1, 2]], tx.pool.tensor[:, :, [3, 4]])
    finally:
        node.close()
