"""The gateway's end of the serving plane: one ROUTER socket that every worker's DEALER connects to.

Driven from the asyncio loop (zmq.asyncio): a receive task decodes each frame with the codec and hands
the record, with the sender's identity (its worker_id), to ``on_record``. A frame that is not a valid
worker -> gateway record is counted and dropped; the loop keeps serving. Sends to a worker that is not
connected fail at once (ROUTER_MANDATORY) and return False.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from protocol.codec import WireError, decode, encode
from protocol.serving import Busy, Goodbye, Heartbeat, PromptLogprobs, TokenEvent
from protocol.zmq_util import bind, make_socket

log = logging.getLogger("pdserve.gateway")

FROM_WORKERS = (Heartbeat, TokenEvent, PromptLogprobs, Busy, Goodbye)
_ROUTER_HWM = 10_000  # token events of every in-flight request pass here; bounded, but not tight


class WorkerLink:
    def __init__(self, host: str, port: int, max_frame_bytes: int,
                 on_record: Callable[[str, object], None], on_malformed: Callable[[str], None]) -> None:
        self._host = host
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self._on_record = on_record
        self._on_malformed = on_malformed
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.address = ""  # the bound endpoint, e.g. tcp://127.0.0.1:8001

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, hwm=_ROUTER_HWM, max_msg_size=self._max_frame_bytes)
        self.address = bind(self._sock, self._host, self._port)
        self._task = asyncio.create_task(self._receive_loop(), name="gateway-worker-link")

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:  # [identity, payload]: anything else is not ours
                self._on_malformed(f"{len(frames) - 1} payload frames")
                continue
            identity, payload = frames
            try:
                worker_id = identity.decode("utf-8")
                record = decode(payload, self._max_frame_bytes)
            except (UnicodeDecodeError, WireError) as e:
                self._on_malformed(str(e)[:200])
                continue
            if not isinstance(record, FROM_WORKERS):
                self._on_malformed(f"{type(record).__name__} is not a worker -> gateway record")
                continue
            try:
                self._on_record(worker_id, record)
            except Exception:  # a bug in one handler must not stop the link for every worker
                log.exception("handling %s from %s failed", type(record).__name__, worker_id)

    async def send(self, worker_id: str, record) -> bool:
        """Queue ``record`` for ``worker_id``; False when the worker is not connected (or the link is closed)."""
        if self._sock is None:
            return False
        try:
            await self._sock.send_multipart([worker_id.encode("utf-8"), encode(record)])
            return True
        except zmq.ZMQError as e:
            log.warning("send %s to %s failed: %s", type(record).__name__, worker_id, e)
            return False

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
        if self._ctx is not None:
            self._ctx.term()
