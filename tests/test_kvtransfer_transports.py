"""Every transport moves blocks bit-exact between pools whose block ids differ; fencing holds."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from engine.kv.pool import KVLayout, KVPool
from kvtransfer.channel import InprocServer, ZmqClient, ZmqServer
from kvtransfer.events import TransferStatus
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import HandshakeError, KVSender
from kvtransfer.shm_pool import create_shared

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
TRANSPORTS = ["loopback", "shm", "zmq"]


def random_pool(layout: KVLayout, seed: int) -> torch.Tensor:
    """A pool of random contents in the layout's dtype (int8 pools: random bytes, scales included)."""
    g = torch.Generator().manual_seed(seed)
    if layout.dtype == torch.int8:
        return torch.randint(-128, 128, layout.shape, dtype=torch.int8, generator=g)
    return torch.randn(layout.shape, generator=g, dtype=layout.dtype)


class Node:
    """A receiver with a free list, and the registry it reports to."""

    def __init__(self, transport: str, credits: int = 3, lease_s: float = 30.0, layout: KVLayout = LAYOUT):
        self.transport = transport
        self.registry = CollectorRegistry()
        self.free = set(range(layout.num_blocks))
        self.shared = create_shared(layout.shape, layout.dtype) if transport == "shm" else None
        pool = KVPool(layout, tensor=self.shared.tensor if self.shared else None)
        if transport == "loopback":
            self.server = InprocServer()
        else:
            self.ctx = zmq.Context()
            self.server = ZmqServer(self.ctx, "127.0.0.1", max_msg_size=1 << 22)
        self.rx = KVReceiver(
            pool,
            "tiny",
            self.server,
            self.free.update,
            TransferMetrics(self.registry),
            lease_s=lease_s,
            credits=credits,
            shm_pool_name=self.shared.name if self.shared else None,
        )

    def reserve(self, rid: str, generation: int, block_ids: list[int]) -> None:
        assert set(block_ids) <= self.free
        self.free -= set(block_ids)
        self.rx.reserve(rid, generation, block_ids)

    def sender(self, layout: KVLayout = LAYOUT, **kwargs) -> KVSender:
        channel = self.server.connect() if self.transport == "loopback" else ZmqClient(self.ctx, self.server.endpoint)
        src = KVPool(layout, tensor=random_pool(layout, seed=7))
        tx = KVSender(src, "tiny", channel, **kwargs)
        stop = threading.Event()
        serving = threading.Thread(target=lambda: [self.rx.poll() for _ in iter(stop.is_set, True)])
        serving.start()  # the handshake blocks; the receiver answers from this thread meanwhile
        try:
            reply = tx.handshake(timeout_s=10)
        finally:
            stop.set()
            serving.join()
        assert reply.transport == self.transport
        return tx

    def sample(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def close(self):
        self.rx.close()
        if self.shared:
            self.shared.unlink()
        if self.transport != "loopback":
            self.ctx.destroy(linger=0)


def pump(node: Node, *senders: KVSender, until=lambda rx, tx: bool(rx or tx), steps: int = 5000):
    rx_events, tx_events = [], []
    for _ in range(steps):
        for tx in senders:
            tx_events += tx.poll()
        rx_events += node.rx.poll()
        if until(rx_events, tx_events):
            break
    return rx_events, tx_events


@pytest.fixture(params=TRANSPORTS)
def node(request):
    n = Node(request.param)
    yield n
    n.close()


def test_blocks_arrive_bit_exact_with_first_token(node):
    unpinned = []
    tx = node.sender(unpin=unpinned.extend)
    src_ids, dst_ids = [0, 5, 2, 9, 11], [14, 3, 8, 1, 6]
    node.reserve("r1", 1, dst_ids)
    tx.send("r1", 1, src_ids[:2], dst_ids[:2])  # first prefill chunk
    tx.send("r1", 1, src_ids[2:], dst_ids[2:])  # second chunk: 3 blocks, exactly the credit window
    tx.commit("r1", 1, first_token=42, first_logprob=-0.5, top_token_ids=[42, 7], top_logprobs=[-0.5, -1.25])
    rx_events, tx_events = pump(node, tx, until=lambda rx, tx: rx and tx)
    [done] = rx_events
    assert done.ok and done.block_ids == tuple(dst_ids)
    assert (done.commit.first_token, done.commit.top_logprobs) == (42, [-0.5, -1.25])
    assert [(e.rid, e.ok) for e in tx_events] == [("r1", True)] and tx.status("r1") is TransferStatus.SUCCESS
    assert torch.equal(node.rx.pool.tensor[:, :, dst_ids], tx.pool.tensor[:, :, src_ids])
    untouched = sorted(set(range(16)) - set(dst_ids))
    assert torch.equal(node.rx.pool.tensor[:, :, untouched], torch.zeros_like(node.rx.pool.tensor[:, :, untouched]))
    assert tx.pinned_blocks() == [] and sorted(unpinned) == sorted(src_ids)
    assert node.rx.adopt("r1") == tuple(dst_ids)
    nbytes = 5 * LAYOUT.bytes_per_block
    assert node.sample("pdserve:kv_transfer_bytes_sum", transport=node.transport) == nbytes
    assert node.sample("pdserve:kv_transfer_seconds_count", transport=node.transport) == 1
    assert node.sample("pdserve:kv_handshakes_total", result="accepted") == 1
    assert node.sample("pdserve:kv_blocks_held_for_peer") == 0


def test_credits_bound_blocks_in_flight():
    node = Node("zmq", credits=2)
    try:
        tx = node.sender()
        node.reserve("r", 1, [10, 11, 12, 13, 14])
        tx.send("r", 1, [0, 1, 2, 3, 4], [10, 11, 12, 13, 14])
        tx.poll()  # ships as much as the window allows, then waits for credits
        give_up = time.monotonic() + 5
        while not node.rx.table.get("r").written and time.monotonic() < give_up:
            node.rx.poll()
        time.sleep(0.05)
        node.rx.poll()  # anything more the sender could have shipped has arrived by now
        assert node.rx.table.get("r").written == {10, 11}
        tx.commit("r", 1)
        rx_events, _ = pump(node, tx)
        assert rx_events[0].ok and torch.equal(node.rx.pool.tensor[:, :, 10:15], tx.pool.tensor[:, :, 0:5])
    finally:
        node.close()


def test_late_write_after_abort_and_reuse_is_rejected(node):
    late, fresh = node.sender(), node.sender()
    fresh.pool.tensor.normal_(generator=torch.Generator().manual_seed(99))  # different data from `late`
    node.reserve("old", 1, [3, 4])
    late.send("old", 1, [0, 1], [3, 4])  # queued: the sender stalls before shipping it
    assert node.rx.abort("old") and node.free >= {3, 4}
    node.reserve("new", 1, [4, 3])  # the same pages, reused by another request
    fresh.send("new", 1, [6, 7], [4, 3])
    fresh.commit("new", 1)
    rx_events, _ = pump(node, fresh, until=lambda rx, tx: rx and tx)
    assert rx_events[0].ok and rx_events[0].rid == "new"
    _, late_events = pump(node, late)  # now the stalled write goes out
    assert [(e.rid, e.ok) for e in late_events] == [("old", False)]
    assert "stale" in late_events[0].reason
    assert torch.equal(node.rx.pool.tensor[:, :, [4, 3]], fresh.pool.tensor[:, :, [6, 7]])  # new owner intact
    assert node.rx.table.get("new").state.name == "COMMITTED"
    if node.transport == "zmq":  # the receiver saw and refused it; direct transports never wrote it
        # One refusal per piece: a 3-credit window ships pieces of one block, so 2 blocks = 2 pieces.
        assert node.sample("pdserve:kv_rejected_writes_total", reason="stale") == 2


def test_retry_generation_fences_off_the_previous_attempt(node):
    unpinned = []
    tx = node.sender(unpin=unpinned.extend)
    node.reserve("r", 1, [2, 3])
    tx.send("r", 1, [0], [2])
    node.rx.abort("r")
    node.reserve("r", 2, [2, 3])  # retry of the same request, next generation
    tx.send("r", 2, [5, 6], [2, 3])  # replaces the queued generation-1 attempt on the sender
    tx.commit("r", 2)
    rx_events, tx_events = pump(node, tx, until=lambda rx, tx: rx and len(tx) == 2)
    assert [(e.rid, e.generation, e.ok) for e in rx_events] == [("r", 2, True)]
    assert [(e.generation, e.ok, e.reason) for e in tx_events] == [
        (1, False, "superseded by generation 2"),
        (2, True, ""),
    ]
    assert tx.pinned_blocks() == [] and sorted(unpinned) == [0, 5, 6]
    assert torch.equal(node.rx.pool.tensor[:, :, [2, 3]], tx.pool.tensor[:, :, [5, 6]])


def test_commit_before_all_blocks_written_fails_and_frees(node):
    tx = node.sender()
    node.reserve("r", 1, [7, 8, 9])
    tx.send("r", 1, [0, 1], [7, 8])
    tx.commit("r", 1)
    rx_events, _ = pump(node, tx)
    assert [(e.ok, e.reason) for e in rx_events] == [(False, "commit before every block was written")]
    assert node.free == set(range(16)) and node.rx.table.held_blocks() == {}


def test_mismatched_peer_refused_naming_the_field(node):
    other = KVLayout(2, 16, 8, 2, 8, torch.float32)  # block size 8 vs 4
    with pytest.raises(HandshakeError, match="block_size is 8 there but 4 here") as info:
        node.sender(layout=other)
    assert info.value.field == "block_size"
    assert node.sample("pdserve:kv_handshakes_total", result="refused") == 1


def test_sender_abort_frees_receiver_range_at_once(node):
    tx = node.sender()
    node.reserve("r", 1, [1, 2])
    tx.send("r", 1, [0], [1])
    pump(node, tx, until=lambda rx, tx: False, steps=20)
    tx.abort("r", 1, reason="client disconnected")
    rx_events, _ = pump(node, tx, until=lambda rx, tx: bool(rx))
    assert [(e.ok, e.reason) for e in rx_events] == [(False, "aborted by sender: client disconnected")]
    assert node.free == set(range(16)) and tx.pinned_blocks() == []


def test_sender_abort_after_commit_leaves_the_committed_range_to_the_receiver(node):
    # Found by the chaos tool: P committed, then an AbortRequest reached P before the CommitAck came
    # back; both frames landed in one receiver poll, the abort freed the committed range behind the
    # pending "committed" event, and the decode node's adopt() raised (the process died).
    tx = node.sender()
    node.reserve("r", 1, [1, 2])
    tx.send("r", 1, [0, 3], [1, 2])
    # shm ships nothing before the receiver grants the transfer's window: let the blocks go out first
    pump(node, tx, until=lambda rx, _: tx.status("r") is TransferStatus.TRANSFERRING)
    tx.commit("r", 1, first_token=9)
    for _ in range(50):  # commit on the wire, not yet read by the receiver
        tx.poll()
    tx.abort("r", 1, reason="gateway: client gone")
    time.sleep(0.2)  # the abort too
    rx_events = node.rx.poll()
    assert [(e.ok, e.rid) for e in rx_events] == [(True, "r")]  # no failure after the commit
    assert node.rx.adopt("r") == (1, 2) and node.free == set(range(16)) - {1, 2}  # the decode node owns them
    assert node.sample("pdserve:kv_blocks_held_for_peer") == 0


def test_restarted_receiver_makes_the_sender_handshake_again():
    node = Node("zmq")
    try:
        tx = node.sender()
        assert not tx.needs_handshake
        port = int(node.server.endpoint.rsplit(":", 1)[1])
        # zmq drops what a DEALER sends into a connection it has not yet seen die: the test waits for the
        # reconnect, as the product's lease deadline covers a request lost that way
        tx.channel.take_lost()
        connected = tx.channel.num_connected
        node.rx.close()  # the decode node restarts on the same port with a new incarnation
        for _ in range(200):  # zmq releases the port asynchronously after close
            try:
                node.server = ZmqServer(node.ctx, "127.0.0.1", port, max_msg_size=1 << 22)
                break
            except zmq.ZMQError:
                time.sleep(0.01)
        node.rx = KVReceiver(
            KVPool(LAYOUT), "tiny", node.server, node.free.update, TransferMetrics(CollectorRegistry())
        )
        give_up = time.monotonic() + 10
        while tx.channel.num_connected == connected and time.monotonic() < give_up:
            tx.channel.take_lost()  # reads the channel's connection events
            time.sleep(0.01)
        assert tx.channel.num_connected > connected, "the sender never reconnected"
        node.reserve("r", 1, [1])
        tx.send("r", 1, [0], [1])
        _, tx_events = pump(node, tx, until=lambda rx, t: bool(t), steps=10**6)
        assert tx_events[0].reason == "rejected by receiver: unknown_incarnation" and tx.needs_handshake
    finally:
        node.close()


def test_sockets_are_bounded_and_never_bind_all_interfaces():
    from protocol.zmq_util import bind, make_socket

    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.ROUTER, hwm=7, max_msg_size=1234)
        assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.MAXMSGSIZE)) == (
            7,
            7,
            1234,
        )
        with pytest.raises(ValueError, match="refusing to bind all interfaces"):
            bind(sock, "0.0.0.0")
        endpoint = bind(sock, "127.0.0.1")
        assert endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: a send to an unknown peer fails loudly
            sock.send_multipart([b"nobody", b"x"], zmq.NOBLOCK)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "src, dst",
    [
        ([0, 1, 2, 3], [8, 9, 10, 11]),  # one run: slice copy
        ([0, 1, 2, 7, 8, 9, 10, 11], [3, 4, 5, 12, 13, 14, 15, 6]),  # runs, plus a break inside the second
        ([5, 0, 9, 2], [1, 7, 3, 12]),
    ],  # scattered: packed gather/scatter
)
def test_copy_blocks_matches_per_block_reference(src, dst):
    from kvtransfer.block_runs import copy_blocks

    source = torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(1))
    target, expected = torch.zeros(LAYOUT.shape), torch.zeros(LAYOUT.shape)
    for s, d in zip(src, dst):
        expected[:, :, d] = source[:, :, s]
    copy_blocks(source, src, target, dst)
    assert torch.equal(target, expected)
