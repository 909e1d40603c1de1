"""The gateway's end of the serving plane: one ROUTER socket that every worker's DEALER connects to.

Driven from the asyncio loop (zmq.asyncio): a receive task decodes each frame with the codec and hands
the record, with the worker id its sender is bound to, to ``on_record``. A frame that is not a valid
worker -> gateway record is counted and dropped; the loop keeps serving. Sends to a worker that is not
connected fail at once (ROUTER_MANDATORY) and return False.

Identity (docs/security.md). A worker's *peer* is the CURVE public key its connection authenticated
with (with ``transfer.insecure``: its connection's routing id). A Heartbeat whose registration proof
verifies binds its worker id to that peer; every other record is attributed to the worker bound to its
peer, never to an id the frame claims, so no one speaks for a worker without its key. A Heartbeat for a
bound id from another peer is refused while the bound peer is still connected (a probe: a send to its
routing id must succeed); a restarted worker (its old connection closed) takes its id over at once.
Sends go to the routing id the bound peer last used. ROUTER_HANDOVER is off (protocol/zmq_util.py), so
a routing id names one live connection: a second connection under a taken one is not heard until the
first is gone, and a frame under the bound routing id from another key means the old one is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from protocol.codec import WireError, decode, encode
from protocol.curve import PlaneSecurity
from protocol.rejects import RejectLog
from protocol.serving import AbortRequest, Busy, Goodbye, Heartbeat, PromptLogprobs, TokenEvent, TokenEvents
from protocol.zmq_util import bind, make_socket

log = logging.getLogger("pdserve.gateway")

FROM_WORKERS = (Heartbeat, TokenEvent, TokenEvents, PromptLogprobs, Busy, Goodbye)
_ROUTER_HWM = 10_000  # token events of every in-flight request pass here; bounded, but not tight


@dataclass(slots=True)
class _Binding:
    peer: str  # the worker's public key (z85), or its routing id (hex) when insecure
    route: bytes  # the ROUTER routing id of its connection
    signer: bytes = b""  # the member key that signed its registration: only that key takes the id over


class WorkerLink:
    def __init__(
        self,
        host: str,
        port: int,
        max_frame_bytes: int,
        on_record: Callable[[str, object], None],
        rejects: RejectLog,
        security: PlaneSecurity | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self._on_record = on_record
        self._rejects = rejects
        self._security = security or PlaneSecurity(None)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._bindings: dict[str, _Binding] = {}  # worker id -> its peer and route
        self._worker_of_peer: dict[str, str] = {}
        self.address = ""  # the bound endpoint, e.g. tcp://127.0.0.1:8001

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, hwm=_ROUTER_HWM, max_msg_size=self._max_frame_bytes)
        self._security.server(self._sock)
        self.address = bind(self._sock, self._host, self._port)
        self._task = asyncio.create_task(self._receive_loop(), name="gateway-worker-link")

    def peer_of(self, worker_id: str) -> str:
        """The key ``worker_id`` registered with ("" when unknown or insecure)."""
        binding = self._bindings.get(worker_id)
        return binding.peer if binding is not None and self._security.is_secure else ""

    def unbind(self, worker_id: str) -> None:
        """The worker left the registry: its id is free for the next key that proves membership."""
        binding = self._bindings.pop(worker_id, None)
        if binding is not None and self._worker_of_peer.get(binding.peer) == worker_id:
            del self._worker_of_peer[binding.peer]

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            route = frames[0].bytes
            peer = self._security.peer_of(frames[-1]) or route.hex()
            if len(frames) != 2:  # [identity, payload]: anything else is not ours
                self._rejects.reject("malformed", peer, f"{len(frames) - 1} payload frames")
                continue
            try:
                record = decode(frames[1].buffer, self._max_frame_bytes)
            except WireError as e:
                self._rejects.reject("malformed", peer, str(e))
                continue
            if not isinstance(record, FROM_WORKERS):
                self._rejects.reject("malformed", peer, f"{type(record).__name__} is not a worker -> gateway record")
                continue
            worker_id = await self._attribute(peer, route, record)
            if worker_id is None:
                continue
            try:
                self._on_record(worker_id, record)
            except Exception as e:  # a bug in one handler must not stop the link for every worker
                self._rejects.reject("handler_error", peer, f"handling {type(record).__name__}: {e!r}", exc_info=True)

    async def _attribute(self, peer: str, route: bytes, record) -> str | None:
        """The worker id ``record`` speaks for, or None (rejected and counted)."""
        if not isinstance(record, Heartbeat):
            worker_id = self._worker_of_peer.get(peer)
            if worker_id is None:
                self._rejects.reject("unregistered", peer, f"{type(record).__name__} before any valid Heartbeat")
                return None
            self._bindings[worker_id].route = route
            return worker_id
        hb = record
        key = self._security.key
        signer = b""
        if key is not None:
            # The role is inside the signed message: only a key listed for hb.role signs for it.
            signer = key.signer_of(peer.encode(), hb.role, hb.worker_id, hb.incarnation, hb.proof)
            if not signer:
                self._rejects.reject(
                    "bad_proof", peer, f"registration of {hb.worker_id[:64]!r} as {hb.role!r} without a valid proof"
                )
                return None
        bound = self._bindings.get(hb.worker_id)
        if bound is not None and bound.peer != peer and bound.signer != signer:
            # A routing id stays its signer's until the registry forgets it (unbind): a restart of that
            # worker takes it over, another member (or another role) cannot squat it in the gap.
            self._rejects.reject("identity_taken", peer, f"{hb.worker_id[:64]!r} is bound to another member key")
            return None
        if bound is not None and bound.peer != peer and bound.route != route and await self._is_connected(bound.route):
            self._rejects.reject("identity_taken", peer, f"{hb.worker_id[:64]!r} is registered by another key")
            return None
        previous = self._worker_of_peer.get(peer)
        if previous is not None and previous != hb.worker_id:
            self._rejects.reject(
                "identity_taken", peer, f"registered as {previous[:64]!r}, now claims {hb.worker_id[:64]!r}"
            )
            return None
        if bound is not None and bound.peer != peer:
            self.unbind(hb.worker_id)  # its old connection is gone: a restarted worker takes its id over
        self._bindings[hb.worker_id] = _Binding(peer, route, signer)
        self._worker_of_peer[peer] = hb.worker_id
        return hb.worker_id

    async def _is_connected(self, route: bytes) -> bool:
        """Whether a connection with this routing id is still up: ROUTER_MANDATORY refuses a send to one
        that is not. The probe is an abort of no request, which workers ignore."""
        try:
            await self._sock.send_multipart([route, encode(AbortRequest("", "connection probe"))])
            return True
        except zmq.ZMQError:
            return False

    async def send(self, worker_id: str, record) -> bool:
        """Queue ``record`` for ``worker_id``; False when the worker is not connected (or the link is closed)."""
        binding = self._bindings.get(worker_id)
        if self._sock is None or binding is None:
            return False
        try:
            await self._sock.send_multipart([binding.route, encode(record)])
            return True
        except zmq.ZMQError as e:
            log.warning("send %s to %s failed: %s", type(record).__name__, worker_id, e)
            return False

    def send_nowait(self, worker_id: str, record) -> None:
        """Queue ``record`` without waiting (from a receive handler); a worker not connected, or a full
        queue, drops it: what goes this way is resent on the next heartbeat."""
        if self._sock is None:
            return
        sent = self._sock.send_multipart([worker_id.encode("utf-8"), encode(record)], flags=zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is read, not raised

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._security.close()
        if self._ctx is not None:
            self._ctx.term()
