"""One KVSender per decode worker KV endpoint, handshaken once per receiver incarnation.

The handshake picks the transport (the receiver chooses among what we offer: shm on one host on CPU,
cuda_ipc on one host on GPU, zmq otherwise; loopback only exists inside one process). A sender whose
receiver restarted (a WriteRejected for an unknown incarnation) asks for a new handshake before its
next transfer.
"""

from __future__ import annotations

import logging

import zmq

from engine.kv_pool import KVPool
from kvtransfer.channel import ZmqClient
from kvtransfer.events import TransferEvent
from kvtransfer.metrics import TransferMetrics
from kvtransfer.sender import HandshakeError, KVSender

log = logging.getLogger(__name__)


class KVSenders:
    def __init__(self, ctx: zmq.Context, pool: KVPool, model_name: str, metrics: TransferMetrics, *,
                 transports: tuple[str, ...], deadline_s: float, handshake_timeout_s: float = 5.0,
                 max_frame_bytes: int = 64 << 20):
        self._ctx = ctx
        self._pool = pool
        self._model_name = model_name
        self._metrics = metrics
        self._transports = transports
        self._deadline_s = deadline_s
        self._handshake_timeout_s = handshake_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._senders: dict[str, KVSender] = {}  # kv address -> sender

    def get(self, address: str) -> KVSender:
        """The handshaken sender for ``address``; raises HandshakeError when the receiver refuses us
        or does not answer in time (blocks up to the handshake timeout)."""
        sender = self._senders.get(address)
        if sender is None:
            channel = ZmqClient(self._ctx, address, max_msg_size=self._max_frame_bytes)
            sender = KVSender(self._pool, self._model_name, channel, deadline_s=self._deadline_s,
                              transports=self._transports, metrics=self._metrics)
            self._senders[address] = sender
        if sender.needs_handshake:
            try:
                reply = sender.handshake(self._handshake_timeout_s)
            except HandshakeError as exc:
                self._metrics.handshakes.labels("failed").inc()
                if not exc.field:  # unreachable: start from a fresh socket next time
                    sender.channel.close()
                    del self._senders[address]
                raise
            log.info("handshake with %s: transport %s, %d credits", address, reply.transport, reply.credits)
        return sender

    def abort(self, address: str, rid: str, generation: int, reason: str) -> None:
        """Abort a transfer (unpins its pieces, tells the receiver); a no-op without a sender."""
        sender = self._senders.get(address)
        if sender is not None:
            sender.abort(rid, generation, reason)

    def poll(self) -> list[TransferEvent]:
        events: list[TransferEvent] = []
        for sender in self._senders.values():
            events += sender.poll()
        return events

    def pinned_blocks(self) -> list[int]:
        return [b for s in self._senders.values() for b in s.pinned_blocks()]

    def close(self) -> None:
        for sender in self._senders.values():
            sender.channel.close()
        self._senders.clear()
