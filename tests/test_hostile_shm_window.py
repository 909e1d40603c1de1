"""shm hands a peer one window of only its transfer's blocks, never the decode worker's pool
(kvtransfer/shm_window.py): the handshake names no pool and no fence, a key holder not assigned the range
gets no window, the assigned peer's writes reach the pool only for its reserved blocks, the window's file
is gone from /dev/shm once mapped, and nothing outside the reserved blocks changes or stays held."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from cluster.keygen import main as keygen
from engine.kv.pool import KVLayout, KVPool
from kvtransfer import shm_pool
from kvtransfer.channel import ZmqClient, ZmqServer
from kvtransfer.events import TransferStatus
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.shm_pool import SHM_DIR, create_shared
from protocol.codec import decode, encode
from protocol.curve import ClusterKey, PlaneSecurity
from protocol.kv_messages import BlockWrite, Credit, WindowRequest, WriteRejected

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
RESERVED, SRC = [3, 4], [0, 5]


def random_pool(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def windows_on_disk() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"pdserve-win-{os.getpid()}-")]


class Plane:
    """A decode worker's KV receiver (shm pool, CURVE) and prefill key holders connecting to it."""

    def __init__(self, keys: str):
        decode_key, self.prefill_key = (ClusterKey.from_file(f"{keys}/{r}.key") for r in ("decode", "prefill"))
        self.rx_ctx, self.tx_ctx = zmq.Context(), zmq.Context()  # one ZAP handler per context
        self.rx_security = PlaneSecurity(decode_key, "decode")
        self.shared = create_shared(LAYOUT.shape, LAYOUT.dtype)
        pool = KVPool(LAYOUT, tensor=self.shared.tensor)
        pool.tensor.copy_(random_pool(1))  # other requests' KV
        self.server = ZmqServer(self.rx_ctx, "127.0.0.1", max_msg_size=1 << 22, security=self.rx_security)
        self.free: set[int] = set(range(LAYOUT.num_blocks))
        self.rx_events: list = []  # what the receiver reported while raw_reply polled it
        self.rx = KVReceiver(
            pool,
            "tiny",
            self.server,
            self.free.update,
            TransferMetrics(CollectorRegistry()),
            shm_pool_name=self.shared.name,
        )

    def sender(self) -> tuple[KVSender, PlaneSecurity]:
        security = PlaneSecurity(self.prefill_key, "prefill")  # a client key of its own
        tx = KVSender(
            KVPool(LAYOUT, tensor=random_pool(7)),
            "tiny",
            ZmqClient(self.tx_ctx, self.server.endpoint, security=security),
        )
        stop = threading.Event()
        serving = threading.Thread(target=lambda: [self.rx.poll() for _ in iter(stop.is_set, True)])
        serving.start()
        try:
            reply = tx.handshake(timeout_s=10)
        finally:
            stop.set()
            serving.join()
        assert (reply.transport, reply.shm_pool_name, reply.shm_fence_name) == ("shm", None, None)  # nothing named
        return tx, security

    def pump(self, tx: KVSender, until, steps: int = 5000) -> tuple[list, list]:
        rx_events, tx_events = [], []
        for _ in range(steps):
            tx_events += tx.poll()
            rx_events += self.rx.poll()
            if until(rx_events, tx_events):
                break
        return rx_events, tx_events

    def raw_reply(self, tx: KVSender, frames: list) -> object:
        """The receiver's answer to ``frames`` sent on ``tx``'s connection behind its back (a Credit, which
        every write record earns, is skipped; the sender object never sees either)."""
        assert tx.channel.send(frames)
        for _ in range(5000):
            self.rx_events += self.rx.poll()
            if (reply := tx.channel.recv()) is not None and not isinstance(record := decode(reply[0]), Credit):
                return record
        raise AssertionError("no reply")

    def close(self) -> None:
        self.rx.close()
        self.shared.unlink()
        self.rx_security.close()
        self.rx_ctx.destroy(linger=0)
        self.tx_ctx.destroy(linger=0)


@pytest.fixture
def plane(tmp_path):
    assert keygen(["--out", str(tmp_path)]) == 0
    p = Plane(str(tmp_path))
    yield p
    p.close()


def test_a_peer_gets_only_its_window_and_writes_only_its_reserved_blocks(plane):
    assigned, assigned_security = plane.sender()
    intruder, _ = plane.sender()  # a prefill key holder too, not assigned this request
    before = plane.rx.pool.tensor.clone()
    plane.free -= set(RESERVED)
    plane.rx.reserve("r1", 1, RESERVED, sender_key=assigned_security.client_public.decode())

    # The intruder asks for the range's window: refused, no window made.
    refused = plane.raw_reply(intruder, [encode(WindowRequest("r1", 1, intruder.incarnation))])
    assert refused == WriteRejected("r1", 1, "not_assigned") and len(plane.rx.windows) == 0

    # The assigned peer's blocks land through its window; the file is gone from /dev/shm once it wrote.
    assigned.send("r1", 1, SRC, RESERVED)
    plane.pump(assigned, until=lambda rx, tx: assigned.status("r1") is TransferStatus.TRANSFERRING)
    plane.pump(assigned, until=lambda rx, tx: False, steps=50)  # the receiver reads the write records
    assert len(plane.rx.windows) == 1 and windows_on_disk() == []

    # A write record for a block outside the reservation: refused, and no byte of the pool moves (the
    # peer's only mapping is its two-block window; there is nothing of block 5 it could have written).
    outside = plane.raw_reply(assigned, [encode(BlockWrite("r1", 1, assigned.incarnation, [5], False, 0))])
    assert outside == WriteRejected("r1", 1, "out_of_range")

    assigned.commit("r1", 1, first_token=9)
    rx_events, tx_events = plane.pump(assigned, until=lambda rx, tx: rx and tx)
    assert [(e.ok, e.block_ids) for e in rx_events] == [(True, tuple(RESERVED))]
    assert [e.ok for e in tx_events] == [True]
    pool = plane.rx.pool.tensor
    assert torch.equal(pool[:, :, RESERVED], assigned.pool.tensor[:, :, SRC])
    others = [b for b in range(LAYOUT.num_blocks) if b not in RESERVED]
    assert torch.equal(pool[:, :, others], before[:, :, others])  # nothing outside the reservation changed
    assert plane.rx.adopt("r1") == tuple(RESERVED)
    assert plane.rx.table.held_blocks() == {} and len(plane.rx.windows) == 0 and windows_on_disk() == []


def test_a_write_without_a_window_ends_the_range_uncommitted(plane):
    """A peer that skips the window and only sends write records has copied nothing: the range must not
    commit (its blocks would decode as whatever they held), so it fails and the blocks come back."""
    assigned, security = plane.sender()
    plane.free -= set(RESERVED)
    plane.rx.reserve("r2", 1, RESERVED, sender_key=security.client_public.decode())
    reply = plane.raw_reply(assigned, [encode(BlockWrite("r2", 1, assigned.incarnation, RESERVED, False, 0))])
    assert reply == WriteRejected("r2", 1, "wrong_state")
    assert [(e.ok, e.reason) for e in plane.rx_events] == [(False, "write without a window")]
    assert plane.rx.table.held_blocks() == {} and plane.free == set(range(LAYOUT.num_blocks))


def test_no_room_for_a_window_fails_the_transfer_at_once(plane, monkeypatch):
    assigned, security = plane.sender()
    plane.free -= set(RESERVED)
    plane.rx.reserve("r3", 1, RESERVED, sender_key=security.client_public.decode())
    monkeypatch.setattr(shm_pool, "shm_free_bytes", lambda directory=SHM_DIR: 0)  # only the reader is replaced
    assert plane.raw_reply(assigned, [encode(WindowRequest("r3", 1, assigned.incarnation))]) == WriteRejected(
        "r3", 1, "stale"
    )
    [failed] = plane.rx_events
    assert not failed.ok and failed.reason.startswith("no shm window: /dev/shm has 0 bytes free")
    assert plane.rx.table.held_blocks() == {} and plane.free == set(range(LAYOUT.num_blocks))
    assert len(plane.rx.windows) == 0 and windows_on_disk() == []
