"""The worker's socket to one gateway: a DEALER (a CURVE client of the cluster's key) whose ZeroMQ
identity is the worker id.

Frames are single msgpack records (protocol/serving.py). A frame that does not decode into a record
the gateway may send is dropped and counted (``num_rejected``); the worker keeps running. Sends never
block: when the gateway is gone or slow and the queue is full, the record is dropped and counted
(heartbeats re-register the worker once the gateway is back; streams are the gateway's to time out).

The gateway answers every heartbeat with a ``HeartbeatAck`` carrying its id; the socket keeps the id
and when it last heard one (``gateway_id``, ``last_ack_at``), which is how a worker serving several
gateways knows which is which and which one died (worker/gateway_links.py).

The gateway knows the worker by the key it registered with (the Heartbeat's proof), not by the identity,
which only names the connection (gateway/workers/worker_link.py). A socket monitor reports a lost connection to
the gateway (closed, or its ZMTP heartbeats stopped): ``take_lost`` is then True once, and the worker aborts
what that gateway asked of it, since the gateway either restarted or gave those requests up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import WireError, decode, encode
from protocol.curve import PlaneSecurity
from protocol.serving import AbortRequest, Generate, HeartbeatAck, LoRAAdapterSet
from protocol.zmq_util import make_socket

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20  # a Generate carries a whole prompt: generous, still bounded
GATEWAY_RECORDS = (Generate, AbortRequest, LoRAAdapterSet)  # what a gateway sends to a worker (besides acks)


class WorkerSocket:
    def __init__(
        self,
        ctx: zmq.Context,
        gateway_address: str,
        worker_id: str,
        *,
        accepted: tuple[type, ...] = GATEWAY_RECORDS,
        hwm: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        security: PlaneSecurity | None = None,
    ):
        self.address = gateway_address
        self.worker_id = worker_id
        self.gateway_address = gateway_address  # names the gateway in per-gateway state
        self.accepted = accepted  # a prefill worker passes (AbortRequest,)
        self._ctx, self._hwm, self._clock = ctx, hwm, clock
        self.security = security or PlaneSecurity(None)
        self._lost = False
        self._proofs: dict[str, str] = {}  # incarnation -> registration proof
        self.sock = self._connect()
        self.num_rejected = 0  # frames that were not a valid record of an accepted type
        self.num_dropped = 0  # records not sent: the gateway's queue was full or unreachable
        self.gateway_id = ""  # the id in the gateway's last ack; "" before the first (or since a reset)
        self.last_ack_at = 0.0  # clock() when that ack came
        self.replaced_ids: list[str] = []  # ids acked before another one came: gateways that restarted

    def _connect(self) -> zmq.Socket:
        sock = make_socket(self._ctx, zmq.DEALER, hwm=self._hwm, max_msg_size=MAX_FRAME_BYTES)
        self.security.client(sock, "gateway")
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        return sock

    def reset(self) -> None:
        """A new socket to the same address: what was queued for a dead gateway is dropped, and the
        link waits for an ack again."""
        self._close_socket()
        self.sock = self._connect()
        self.gateway_id = ""

    def forget_ack(self) -> None:
        """The gateway went silent: wait for its ack again on the same connection."""
        self.gateway_id = ""

    def registration_proof(self, incarnation: str, role: str) -> str:
        """What the Heartbeat's ``proof`` carries (protocol/curve.py)."""
        if incarnation not in self._proofs:
            self._proofs[incarnation] = self.security.registration_proof(self.worker_id, incarnation, role)
        return self._proofs[incarnation]

    def send(self, record) -> bool:
        try:
            self.sock.send(encode(record), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.num_dropped += 1
            return False

    def take_lost(self) -> bool:
        """True (once) when the connection to the gateway went down since the last call."""
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._lost = True
        lost, self._lost = self._lost, False
        if lost:
            log.warning("lost the connection to the gateway at %s", self.gateway_address)
        return lost

    def poll(self, timeout_ms: int = 0, max_records: int = 1024) -> list:
        """Records that arrived, waiting up to ``timeout_ms`` for the first one. Acks are taken here."""
        records: list = []
        if timeout_ms and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return records
        while len(records) < max_records:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if len(frames) != 1:
                    raise WireError(f"{len(frames)} frames, expected 1")
                record = decode(frames[0], MAX_FRAME_BYTES)
                if not isinstance(record, (HeartbeatAck, *self.accepted)):
                    raise WireError(f"{type(record).__name__} is not a gateway message")
            except WireError as exc:
                self.num_rejected += 1
                log.warning("rejected frame from gateway %s: %s", self.address, exc)
                continue
            if isinstance(record, HeartbeatAck):
                self._on_ack(record.gateway_id)
            elif isinstance(record, AbortRequest) and not record.rid:
                continue  # the gateway's connection probe (gateway/workers/worker_link.py)
            else:
                records.append(record)
        return records

    def _on_ack(self, gateway_id: str) -> None:
        if self.gateway_id and gateway_id != self.gateway_id:
            self.replaced_ids.append(self.gateway_id)
        if gateway_id != self.gateway_id:
            log.info("gateway %s at %s acknowledged this worker", gateway_id, self.address)
        self.gateway_id = gateway_id
        self.last_ack_at = self._clock()

    def close(self) -> None:
        self._close_socket()

    def _close_socket(self) -> None:
        if not self.sock.closed:  # idempotent; a context destroyed first closed it already
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
