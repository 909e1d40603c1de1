"""DEALER sockets to prefill workers, connected lazily, one per address the gateway names.

decode -> prefill: PrefillJob, AbortRequest;  prefill -> decode: PrefillFailed. Sends never block:
a prefill worker that is gone or full makes ``send`` return False and the caller fails the request.
Addresses come from the gateway, which took them from the prefill workers' heartbeats: one that is not a
tcp endpoint fails its request (``send`` is False), never this worker.
"""

from __future__ import annotations

import logging

import zmq

from protocol.codec import WireError, decode, encode
from protocol.curve import PlaneSecurity
from protocol.endpoints import endpoint_error
from protocol.serving import PrefillFailed
from protocol.zmq_util import make_socket

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 64 * 1024  # PrefillFailed is small
MAX_LINKS = 256  # distinct prefill addresses kept connected at most (the oldest idle one is dropped)


class PrefillLinks:
    def __init__(self, ctx: zmq.Context, worker_id: str, security: PlaneSecurity | None = None):
        self._ctx = ctx
        self._identity = worker_id.encode()  # the prefill worker's ROUTER sees us by our worker id
        self._security = security or PlaneSecurity(None)
        self._socks: dict[str, zmq.Socket] = {}
        self.num_rejected = 0  # frames from prefill workers that were not a PrefillFailed

    def send(self, address: str, record) -> bool:
        sock = self._socks.get(address)
        if sock is None:
            if error := endpoint_error(address):
                log.warning("prefill address refused: %s", error)
                return False
            if len(self._socks) >= MAX_LINKS:
                oldest = next(iter(self._socks))
                self._socks.pop(oldest).close(linger=0)
            sock = self._security.client(make_socket(self._ctx, zmq.DEALER, max_msg_size=MAX_REPLY_BYTES), "prefill")
            sock.setsockopt(zmq.IDENTITY, self._identity)
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:  # e.g. a name that does not resolve
                log.warning("cannot connect to prefill worker %s: %s", address[:80], exc)
                sock.close(linger=0)
                return False
            self._socks[address] = sock
        try:
            # A fresh DEALER queues while it connects; EAGAIN only when the queue (HWM) is full.
            sock.send(encode(record), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def sockets(self) -> list[zmq.Socket]:
        return list(self._socks.values())

    def poll(self) -> list[tuple[str, PrefillFailed]]:
        out = []
        for address, sock in self._socks.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    if len(frames) != 1:
                        raise WireError(f"{len(frames)} frames, expected 1")
                    out.append((address, decode(frames[0], MAX_REPLY_BYTES, expected=PrefillFailed)))
                except WireError as exc:
                    self.num_rejected += 1
                    log.warning("rejected frame from prefill worker %s: %s", address, exc)
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
