"""Attackers' tools for the hostile-peer suite (tests/hostile_attacks.py, tests/test_hostile_peers.py, the
chaos tool's hostile scenarios): sockets speaking the project's own protocol, with or without the cluster
key (protocol/curve.py), as someone on the worker network would, and fake workers a key holder runs."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import torch
import zmq

from engine.kv.pool import KVLayout, KVPool
from kvtransfer.channel import ZmqClient
from kvtransfer.events import TransferEvent
from kvtransfer.sender import KVSender
from protocol.codec import decode, encode
from protocol.curve import ClusterKey, PlaneSecurity
from protocol.kv_messages import HandshakeReply, WindowGrant, WindowRequest
from protocol.serving import Goodbye, Heartbeat, PrefillJob, SamplingSpec
from protocol.zmq_util import bind, make_socket
from tests.model_factory import tiny_model_dir

MODEL = str(tiny_model_dir("llama"))


def key_holder(key_file: str) -> PlaneSecurity:
    """A process holding the cluster key: it can complete CURVE handshakes (its own client key)."""
    return PlaneSecurity(ClusterKey.from_file(key_file))


def dealer(
    ctx: zmq.Context,
    endpoint: str,
    security: PlaneSecurity | None = None,
    identity: bytes | None = None,
    server_role: str = "gateway",
) -> zmq.Socket:
    sock = make_socket(ctx, zmq.DEALER)
    if security is not None:
        security.client(sock, server_role)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def heartbeat(
    worker_id: str, role: str, address: str, incarnation: str, proof: str = "", draining: bool = False
) -> Heartbeat:
    return Heartbeat(worker_id, role, address, incarnation, 16, 64, 64, 0, 0, 0, 0, draining=draining, proof=proof)


def register(
    sock: zmq.Socket, security: PlaneSecurity, worker_id: str, role: str, address: str, draining: bool = False
) -> str:
    """Send a Heartbeat with a valid membership proof for ``security``'s key; returns the incarnation."""
    incarnation = uuid.uuid4().hex
    proof = security.registration_proof(worker_id, incarnation, role)
    sock.send(encode(heartbeat(worker_id, role, address, incarnation, proof, draining)))
    return incarnation


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def job(rid: str, kv_address: str, block_size: int, num_tokens: int | None = None) -> PrefillJob:
    """A well-formed PrefillJob for ``rid`` (tests spoil one field at a time)."""
    num_tokens = num_tokens or 2 * block_size + 3
    return PrefillJob(
        rid,
        prompt_of(num_tokens, seed=len(rid)),
        0,
        list(range(-(-num_tokens // block_size))),
        1,
        kv_address,
        True,
        SamplingSpec(max_tokens=1, temperature=0.0),
        time.time() + 60,
    )


def tiny_layout(block_size: int, num_blocks: int = 64) -> KVLayout:
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return KVLayout(
        config["num_hidden_layers"], num_blocks, block_size, config["num_key_value_heads"], head_dim, torch.float32
    )


def kv_sender(
    ctx: zmq.Context, kv_address: str, security: PlaneSecurity, block_size: int, transports=("zmq",)
) -> KVSender:
    """The project's own KV sender, over ``transports`` (zmq; shm: a window per transfer), with the
    attacker's key; handshaken."""
    pool = KVPool(tiny_layout(block_size), tensor=torch.full(tiny_layout(block_size).shape, 7.0))
    sender = KVSender(
        pool, MODEL, ZmqClient(ctx, kv_address, max_msg_size=64 << 20, security=security), transports=transports
    )
    sender.handshake(timeout_s=30)
    return sender


def drive(sender: KVSender, until, timeout_s: float = 30.0) -> list:
    """Poll ``sender`` until ``until(events)``; returns its events."""
    events, give_up = [], time.monotonic() + timeout_s
    while not until(events) and time.monotonic() < give_up:
        events += sender.poll()
        time.sleep(0.002)
    return events


class FakeReceiver:
    """A KV receiver (a key holder's ROUTER, a CURVE server of the cluster) that answers every handshake
    with ``reply``: a hostile one."""

    def __init__(
        self, ctx: zmq.Context, security: PlaneSecurity, reply: HandshakeReply, window: tuple[str, list[int]] = ()
    ):
        """``window``: (segment name, block ids) of the WindowGrant it answers a shm WindowRequest with."""
        self.sock = security.server(make_socket(ctx, zmq.ROUTER))
        self.address = bind(self.sock, "127.0.0.1", 0)
        self.reply = reply
        self.window = window
        self.num_handshakes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                peer, first, *_ = self.sock.recv_multipart()
                record = decode(first)
                if isinstance(record, WindowRequest) and self.window:
                    grant = WindowGrant(record.rid, record.generation, *self.window)
                    self.sock.send_multipart([peer, encode(grant)])
                    continue
                self.num_handshakes += 1
                self.sock.send_multipart([peer, encode(self.reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


def replies(sock: zmq.Socket, count: int = 1, timeout_s: float = 30.0) -> list:
    out, give_up = [], time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < give_up:
        if sock.poll(200):
            out.append(decode(sock.recv_multipart()[-1]))
    return out


def hostname() -> str:
    return socket.gethostname()


class _RegisteredPrefill:
    """A key holder heartbeating as prefill worker ``worker_id`` from a thread of its own, with
    ``address`` its job endpoint (a ROUTER of its own where None); each record that arrives there goes
    to ``_on_job``."""

    def __init__(
        self,
        ctx: zmq.Context,
        gateway: str,
        security: PlaneSecurity,
        worker_id: str,
        address: str | None = None,
        identity: bytes | None = None,
    ):
        self.worker_id, self.security = worker_id, security
        self.jobs = None if address else security.server(make_socket(ctx, zmq.ROUTER))
        self.address = address or bind(self.jobs, "127.0.0.1", 0)
        self.gateway = dealer(ctx, gateway, security, identity)
        self.incarnation = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_job(self, record) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        next_heartbeat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_heartbeat:
                proof = self.security.registration_proof(self.worker_id, self.incarnation, "prefill")
                self.gateway.send(encode(heartbeat(self.worker_id, "prefill", self.address, self.incarnation, proof)))
                next_heartbeat = time.monotonic() + 0.2
            if self.jobs is None:
                time.sleep(0.02)
            elif self.jobs.poll(20):  # a PrefillJob, or the AbortRequest its decode worker sends after it
                self._on_job(decode(self.jobs.recv_multipart()[-1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.gateway.send(encode(Goodbye(self.worker_id)))
        self.gateway.close(linger=100)
        if self.jobs is not None:
            self.jobs.close(linger=0)
        self.security.close()  # its ZAP handler, before the context ends


class SilentPrefill(_RegisteredPrefill):
    """A key holder registered as a prefill worker (its id sorts before ``prefill-0``: the router's
    tie-break picks it) that never delivers: it takes jobs on a socket of its own and sits on them
    (``address`` None), or advertises ``address``, where nothing answers (a closed port, a blackhole)."""

    def __init__(self, ctx: zmq.Context, gateway: str, security: PlaneSecurity, worker_id: str, address: str | None):
        super().__init__(ctx, gateway, security, worker_id, address)
        self.num_jobs = 0  # PrefillJobs received (and never done)
        self._thread.start()

    def _on_job(self, record) -> None:
        self.num_jobs += isinstance(record, PrefillJob)


class FakePrefill(_RegisteredPrefill):
    """A key holder registered as a prefill worker (its id sorts first: the router's tie-break picks it).
    It writes the job's KV (every value 7.0: wrong) and commits ``first_token`` (by
    default outside the vocabulary; the right one makes the wrong KV pass the decode worker's check)."""

    def __init__(
        self, ctx: zmq.Context, gateway: str, security: PlaneSecurity, block_size: int, first_token: int = 10**9
    ):
        super().__init__(ctx, gateway, security, "a-fake-prefill", identity=b"a-fake-prefill")
        self.ctx, self.block_size, self.first_token = ctx, block_size, first_token
        self.events: list[TransferEvent] = []
        self._thread.start()

    def _on_job(self, record) -> None:
        if isinstance(record, PrefillJob):  # (not the AbortRequest its decode worker sends after it)
            self._poison(record)

    def _poison(self, j: PrefillJob) -> None:
        sender = kv_sender(self.ctx, j.kv_address, self.security, self.block_size)
        sender.send(j.rid, j.generation, list(range(len(j.dst_block_ids))), j.dst_block_ids)
        sender.commit(j.rid, j.generation, first_token=self.first_token)
        self.events += drive(sender, lambda events: bool(events))
        sender.channel.close()
