"""cuda_ipc: a window per transfer, never the receiver's pool (kvtransfer/cuda_window.py, cuda_ipc.py).

Between two processes (an IPC handle cannot be opened in the process that exported it): the window's
handle maps exactly its own allocation, not a byte more; the assigned sender's blocks land bit-exact
through it; a key holder not assigned the range gets no window at all; a write record for a block outside
the reservation moves nothing; the window comes back to the arena scrubbed once the sender released it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB2 = 2 * 2**20
RESERVED, SRC = [30, 2, 17], [0, 3, 5]


def child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


IMPORTER = """
    import sys, torch
    from kvtransfer import cuda_ipc
    from protocol.kv_messages import CudaIpcHandle
    handle = CudaIpcHandle(0, bytes.fromhex(sys.argv[1]), int(sys.argv[2]))
    mapped = cuda_ipc.import_buffer(handle, 0)
    base, size = cuda_ipc.mapped_range(mapped)
    assert (base, size, mapped.num_bytes) == (mapped.ptr, handle.size_bytes, handle.size_bytes), (base, size)
    print(int(mapped.bytes().sum()), flush=True)  # the window's bytes, as the peer sees them
    mapped.bytes().fill_(5)
    torch.cuda.synchronize()
    mapped.free()
    try:  # a grant claiming more than the allocation is refused, not mapped
        cuda_ipc.import_buffer(CudaIpcHandle(0, handle.handle, handle.size_bytes + 2 * 2**20), 0)
        print("mapped a wrong size", flush=True)
    except ValueError:
        print("refused", flush=True)
"""


def test_a_window_handle_maps_exactly_its_own_allocation():
    from kvtransfer import cuda_ipc

    neighbour = cuda_ipc.allocate(0, MIB2)  # allocated next to it: another transfer's window
    neighbour.bytes().fill_(9)
    window = cuda_ipc.allocate(0, MIB2)
    window.bytes()[:1000].fill_(3)
    torch.cuda.synchronize()  # the peer reads what is there, not what is queued
    handle = cuda_ipc.export(window)
    assert handle.size_bytes == MIB2 and cuda_ipc.mapped_range(window) == (window.ptr, MIB2)
    proc = child(IMPORTER, handle.handle.hex(), str(handle.size_bytes))
    try:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert out.split() == ["3000", "refused"]
        assert bool((window.bytes() == 5).all())  # the peer wrote its whole mapping: the window, all of it
        assert bool((neighbour.bytes() == 9).all())  # and nothing beyond it
    finally:
        proc.kill()
        window.free()
        neighbour.free()


SENDER = """
    import sys, torch, zmq
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer import cuda_ipc
    from kvtransfer.channel import ZmqClient
    from kvtransfer.events import TransferStatus
    from kvtransfer.sender import KVSender
    from protocol.codec import decode, encode
    from protocol.curve import ClusterKey, PlaneSecurity
    from protocol.kv_messages import BlockWrite, Credit
    layout = KVLayout(2, 32, 16, 2, 64, torch.bfloat16)
    data = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(layout.dtype).cuda()
    security = PlaneSecurity(ClusterKey.from_file(sys.argv[2]), "prefill")
    tx = KVSender(KVPool(layout, tensor=data), "tiny", ZmqClient(zmq.Context(), sys.argv[1], security=security))
    reply = tx.handshake(timeout_s=60)
    assert (reply.transport, reply.cuda_pool, reply.shm_fence_name) == ("cuda_ipc", None, None)  # no pool named
    print(security.client_public.decode(), flush=True)
    sys.stdin.readline()  # the range is reserved for our key
    tx.send("r", 1, [0, 3, 5], [30, 2, 17])
    while tx.status("r") != TransferStatus.TRANSFERRING:
        tx.poll()
    mapping = tx._transfers["r"].mapping
    print(mapping.num_bytes, cuda_ipc.mapped_range(mapping)[1], flush=True)  # all this sender can see
    assert tx.channel.send([encode(BlockWrite("r", 1, tx.incarnation, [5], False, 0))])  # outside the range
    while (frames := tx.channel.recv()) is None or isinstance(record := decode(frames[0]), Credit):
        pass  # the receiver's answer, read behind the sender object's back (it would end the transfer)
    print(type(record).__name__, record.reason, flush=True)
    tx.commit("r", 1, first_token=11)
    while not (events := tx.poll()):
        pass
    print("done", events[0].ok, flush=True)
    sys.stdin.readline()  # the parent saw our WindowRelease (sent when the transfer ended): exit
"""


class Lines:
    """A child's stdout lines, read on a thread so the receiver keeps polling meanwhile."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def wait(self, count: int, rx, timeout_s: float = 120.0) -> list:
        events, give_up = [], time.monotonic() + timeout_s
        while len(self.lines) < count:
            events += rx.poll()
            assert time.monotonic() < give_up and self.proc.poll() in (None, 0), (self.lines, events)
        return events


def raw_reply(rx, tx, frames: list):
    """The receiver's answer (not a Credit) to ``frames`` sent on ``tx``'s connection."""
    from protocol.codec import decode
    from protocol.kv_messages import Credit

    assert tx.channel.send(frames)
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        rx.poll()
        if (reply := tx.channel.recv()) is not None and not isinstance(record := decode(reply[0]), Credit):
            return record
    raise AssertionError("no reply")


def test_blocks_move_through_the_assigned_senders_window_only(tmp_path):
    from cluster.keygen import main as keygen
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqClient, ZmqServer
    from kvtransfer.metrics import TransferMetrics
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender
    from protocol.codec import encode
    from protocol.curve import ClusterKey, PlaneSecurity
    from protocol.kv_messages import WindowRequest, WriteRejected

    assert keygen(["--out", str(tmp_path)]) == 0
    layout = KVLayout(2, 32, 16, 2, 64, torch.bfloat16)
    rx_ctx, tx_ctx = zmq.Context(), zmq.Context()
    rx_security = PlaneSecurity(ClusterKey.from_file(f"{tmp_path}/decode.key"), "decode")
    server = ZmqServer(rx_ctx, "127.0.0.1", max_msg_size=1 << 24, security=rx_security)
    pool = KVPool(layout, device="cuda")
    pool.tensor.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(1)).to(layout.dtype))
    before = pool.tensor.clone()  # other requests' KV
    registry = CollectorRegistry()
    rx = KVReceiver(pool, "tiny", server, lambda ids: None, TransferMetrics(registry))
    proc = child(SENDER, server.endpoint, f"{tmp_path}/prefill.key")
    lines = Lines(proc)
    try:
        lines.wait(1, rx)
        rx.reserve("r", 1, RESERVED, sender_key=lines.lines[0].strip())

        # Another prefill key holder, on the same host and GPU, asks for the range's window: no grant.
        intruder = KVSender(
            KVPool(layout, device="cuda"),
            "tiny",
            ZmqClient(
                tx_ctx,
                server.endpoint,
                security=PlaneSecurity(ClusterKey.from_file(f"{tmp_path}/prefill.key"), "prefill"),
            ),
        )
        intruder.start_handshake(timeout_s=60)
        while intruder.handshake_pending:
            rx.poll()
            intruder.poll()
        assert intruder.transport == "cuda_ipc"
        refused = raw_reply(rx, intruder, [encode(WindowRequest("r", 1, intruder.incarnation))])
        assert refused == WriteRejected("r", 1, "not_assigned") and len(rx.windows) == 0

        proc.stdin.write("go\n")
        proc.stdin.flush()
        events = lines.wait(4, rx)
        assert lines.lines[1].split() == [str(2**21), str(2**21)]  # 3 blocks (48 KiB) in one 2 MiB allocation
        assert lines.lines[2].split() == ["WriteRejected", "out_of_range"]
        assert lines.lines[3].split() == ["done", "True"]
        assert [(e.ok, e.commit.first_token, e.block_ids) for e in events] == [(True, 11, tuple(RESERVED))]
        expected = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(layout.dtype)
        assert torch.equal(rx.pool.tensor[:, :, RESERVED].cpu(), expected[:, :, SRC])
        others = [b for b in range(layout.num_blocks) if b not in RESERVED]
        assert torch.equal(rx.pool.tensor[:, :, others], before[:, :, others])  # nothing else moved
        assert registry.get_sample_value("pdserve:kv_transfer_bytes_count", {"transport": "cuda_ipc"}) == 1

        # The sender released its window: back in the arena, zeroed, handed to the next transfer.
        arena = rx.windows.arena
        give_up = time.monotonic() + 60
        while arena.num_leased and time.monotonic() < give_up:
            rx.poll()
        assert (arena.num_leased, arena.idle_bytes, arena.num_retired) == (0, 2**21, 0)
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        probe = arena.lease("next", 1, "another key", 1)
        assert probe.buffer.num_bytes == 2**21 and int(probe.buffer.bytes().count_nonzero()) == 0
    finally:
        proc.kill()
        rx.close()
        rx_security.close()
        rx_ctx.destroy(linger=0)
        tx_ctx.destroy(linger=0)
