"""Message channels under the transfer protocol: frames in, frames out, never blocking.

A frame list is ``[header bytes, optional raw block bytes]``. The receiver side serves many senders,
so its frames carry a peer id, and the sender's CURVE public key ("" in-process or on an insecure
plane: protocol/curve.py). ``InprocServer`` (one process: tests, loopback) and ``ZmqServer`` /
``ZmqClient`` (ROUTER / DEALER) implement the same small interface (``ServerChannel``, ``ClientChannel``);
the transport a pair uses (kvtransfer/transports/) rides on top of it. A ``ZmqClient`` reports a lost
connection (closed, or its ZMTP heartbeats stopped) once through ``take_lost``.
"""

from __future__ import annotations

import abc
import collections
import itertools
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.curve import PlaneSecurity
from protocol.zmq_util import bind, make_socket

Frames = list[Any]  # bytes, memoryview or zmq.Frame


class ServerChannel(abc.ABC):
    """The receiver's end: (peer id, frames, the peer's public key or "") from many senders."""

    @abc.abstractmethod
    def recv(self) -> tuple[bytes, Frames, str] | None:
        """The next message, the peer that sent it and its CURVE public key ("" in-process or on an
        insecure plane); None when none waits (never blocks)."""

    @abc.abstractmethod
    def send(self, peer: bytes, frames: Frames) -> bool:
        """False when the peer is gone or its queue is full."""

    def offer_loopback(self, pool: torch.Tensor, fence: torch.Tensor) -> bool:
        """Let same-process clients copy straight into ``pool``; True when this channel can."""
        return False

    @property
    def socket(self) -> zmq.Socket | None:
        """The socket whose readiness means messages wait (for a poller to sleep on); None: in-process."""
        return None

    @property
    def authenticates_peers(self) -> bool:
        """Whether every message carries its sender's verified key (a CURVE plane)."""
        return False

    def close(self) -> None:
        pass


class ClientChannel(abc.ABC):
    """The sender's end, to one receiver."""

    @abc.abstractmethod
    def recv(self) -> Frames | None:
        """The next reply; None when none waits (never blocks)."""

    @abc.abstractmethod
    def send(self, frames: Frames) -> bool:
        """False when the frames could not be queued now (retry later)."""

    def loopback_target(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(receiver pool tensor, receiver fence) when both ends share this process, else None."""
        return None

    def take_lost(self) -> bool:
        """True (once) when the connection to the receiver went down since the last call."""
        return False

    @property
    def socket(self) -> zmq.Socket | None:
        """The socket whose readiness means replies wait (for a poller to sleep on); None: in-process."""
        return None

    def close(self) -> None:
        pass


class InprocServer(ServerChannel):
    def __init__(self):
        self._incoming: collections.deque[tuple[bytes, Frames]] = collections.deque()
        self._clients: dict[bytes, InprocClient] = {}
        self._ids = itertools.count()
        self.target: tuple[torch.Tensor, torch.Tensor] | None = None  # the serving receiver's pool, fence

    def offer_loopback(self, pool, fence):
        self.target = (pool, fence)
        return True

    def connect(self) -> InprocClient:
        peer = f"inproc-{next(self._ids)}".encode()
        client = InprocClient(self, peer)
        self._clients[peer] = client
        return client

    def recv(self):
        return (*self._incoming.popleft(), "") if self._incoming else None

    def send(self, peer, frames):
        client = self._clients.get(peer)
        if client is None or client.closed:
            return False
        client.incoming.append([bytes(f) for f in frames])
        return True


class InprocClient(ClientChannel):
    def __init__(self, server: InprocServer, peer: bytes):
        self._server = server
        self._peer = peer
        self.incoming: collections.deque[Frames] = collections.deque()
        self.closed = False

    def recv(self):
        return self.incoming.popleft() if self.incoming else None

    def send(self, frames):
        if self.closed:
            return False
        self._server._incoming.append((self._peer, [bytes(f) for f in frames]))
        return True

    def loopback_target(self):
        return self._server.target

    def close(self):
        self.closed = True


class ZmqServer(ServerChannel):
    """ROUTER bound to one interface; ``max_msg_size`` makes zmq drop any peer sending more."""

    def __init__(
        self,
        ctx: zmq.Context,
        interface: str,
        port: int = 0,
        *,
        max_msg_size: int,
        hwm: int = 256,
        security: PlaneSecurity | None = None,
    ):
        self.sock = make_socket(ctx, zmq.ROUTER, hwm=hwm, max_msg_size=max_msg_size)
        self._security = security or PlaneSecurity(None)
        self._security.server(self.sock)
        self.endpoint = bind(self.sock, interface, port)

    @property
    def socket(self) -> zmq.Socket:
        return self.sock

    @property
    def authenticates_peers(self) -> bool:
        return self._security.is_secure

    def close_security(self) -> None:
        """Stop the ZAP handler this server started (before its context is terminated)."""
        self._security.close()

    def recv(self):
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return parts[0].bytes, [p.buffer for p in parts[1:]], self._security.peer_of(parts[-1])

    def send(self, peer, frames):
        try:
            self.sock.send_multipart([peer, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY: peer gone) or EAGAIN (its HWM is full)
            return False

    def close(self):
        self.sock.close(linger=0)


class ZmqClient(ClientChannel):
    """DEALER; large frames go ``copy=False`` (the caller keeps the buffer alive until credited)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        max_msg_size: int = 1 << 20,
        hwm: int = 256,
        security: PlaneSecurity | None = None,
    ):
        self.sock = make_socket(ctx, zmq.DEALER, hwm=hwm, max_msg_size=max_msg_size)
        (security or PlaneSecurity(None)).client(self.sock, "decode")  # the KV receivers
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.num_connected = 0  # connections that completed their handshake, as far as take_lost has read
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def socket(self) -> zmq.Socket:
        return self.sock

    def recv(self):
        try:
            return [p.buffer for p in self.sock.recv_multipart(zmq.NOBLOCK, copy=False)]
        except zmq.Again:
            return None

    def send(self, frames):
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # no connected receiver yet, or its queue is full
            return False

    def take_lost(self) -> bool:
        lost = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            lost |= event == zmq.EVENT_DISCONNECTED
            self.num_connected += event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return lost

    def close(self):
        if not self.sock.closed:  # idempotent; a context destroyed first closed it already
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
