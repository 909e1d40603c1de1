"""One KVSender per decode worker KV endpoint, handshaken once per receiver incarnation.

The handshake picks the transport (the receiver chooses among what we offer: shm on one host on CPU,
cuda_ipc on one host on GPU, zmq otherwise; loopback only exists inside one process). A sender whose
receiver restarted (a WriteRejected for an unknown incarnation) asks for a new handshake before its
next transfer. A receiver restarted in place (same address, a new incarnation: a container restarted
by Docker or Kubernetes) is noticed before any transfer: each job names the receiver incarnation it
comes from, and one newer than our handshake fails what went to the old process and handshakes again,
so the job itself succeeds; a job from an incarnation we outlived fails at once (its D is gone).
Handshakes never block the prefill loop: a job waits in the admission queue while the handshake for
its receiver is in flight, and fails at once when that handshake failed.

A receiver whose connection went down (it exited, or its ZMTP heartbeats stopped) is forgotten: its
transfers fail and unpin, its socket closes and its shm mapping goes with the sender; a later job for
that address handshakes again. Addresses come from peers: a malformed one fails its job, nothing more.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import zmq

from engine.kv.pool import KVPool
from kvtransfer.channel import ZmqClient
from kvtransfer.events import TransferEvent
from kvtransfer.metrics import TransferMetrics
from kvtransfer.sender import HandshakeError, KVSender
from protocol.curve import PlaneSecurity
from protocol.endpoints import endpoint_error

log = logging.getLogger(__name__)

MAX_OUTLIVED = 8  # receiver incarnations remembered per address as gone


class KVSenders:
    def __init__(
        self,
        ctx: zmq.Context,
        pool: KVPool,
        model_name: str,
        metrics: TransferMetrics,
        *,
        transports: tuple[str, ...],
        deadline_s: float,
        handshake_timeout_s: float = 5.0,
        max_frame_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
        security: PlaneSecurity | None = None,
    ):
        self._security = security or PlaneSecurity(None)
        self._ctx = ctx
        self._pool = pool
        self._model_name = model_name
        self._metrics = metrics
        self._transports = transports
        self._deadline_s = deadline_s
        self._handshake_timeout_s = handshake_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._senders: dict[str, KVSender] = {}  # kv address -> sender
        # address -> (error, until): jobs for a receiver that just failed its handshake fail at once
        # instead of each waiting out a handshake of its own.
        self._failed: dict[str, tuple[HandshakeError, float]] = {}
        # address -> receiver incarnations gone: those that restarted away from under our handshake, and
        # those a job named that the receiver no longer was when we handshook again for it
        self._outlived: dict[str, collections.deque[str]] = {}
        self._awaited: dict[str, str] = {}  # address -> the incarnation a job named, while we handshake again

    def prepare(self, address: str, incarnation: str = "") -> bool:
        """True when the sender for ``address`` is handshaken (with receiver ``incarnation``, when one
        is named). False while its handshake is in flight (started here; ``poll`` finishes it). Raises
        the HandshakeError when the receiver refused us, did not answer within the last
        ``handshake_timeout_s``, or ``incarnation`` is one that restarted since. Never blocks."""
        if incarnation in self._outlived.get(address, ()):
            raise HandshakeError(
                f"the job's receiver incarnation {incarnation[:16]} is gone (its decode worker restarted)"
            )
        failed = self._failed.get(address)
        if failed is not None:
            if self._clock() < failed[1]:
                raise failed[0]
            del self._failed[address]
        sender = self._senders.get(address)
        if sender is None:
            if error := endpoint_error(address):
                raise HandshakeError(f"bad KV address: {error}")
            try:
                channel = ZmqClient(self._ctx, address, max_msg_size=self._max_frame_bytes, security=self._security)
            except zmq.ZMQError as exc:
                raise HandshakeError(f"cannot connect to {address[:80]!r}: {exc}") from None
            sender = KVSender(
                self._pool,
                self._model_name,
                channel,
                deadline_s=self._deadline_s,
                transports=self._transports,
                metrics=self._metrics,
                clock=self._clock,
            )
            self._senders[address] = sender
        if incarnation and not sender.needs_handshake and sender.peer_incarnation != incarnation:
            self._on_receiver_restart(address, sender, incarnation)
        if sender.needs_handshake and not sender.handshake_pending:
            sender.start_handshake(self._handshake_timeout_s)
        return not sender.needs_handshake

    def get(self, address: str) -> KVSender | None:
        """The handshaken sender for ``address``; None when there is none (never handshaken, or the
        receiver restarted since: its reservations are gone with it)."""
        sender = self._senders.get(address)
        return sender if sender is not None and not sender.needs_handshake else None

    def abort(self, address: str, rid: str, generation: int, reason: str) -> None:
        """Abort a transfer (unpins its pieces, tells the receiver); a no-op without a sender."""
        sender = self._senders.get(address)
        if sender is not None:
            sender.abort(rid, generation, reason)

    def poll(self) -> list[TransferEvent]:
        events: list[TransferEvent] = []
        for address, sender in list(self._senders.items()):
            if sender.channel.take_lost():
                log.warning("KV receiver at %s disconnected: its transfers fail, its sender closes", address)
                sender.fail_all("receiver disconnected")
                events += sender.poll()
                sender.channel.close()
                del self._senders[address]
                continue
            pending = sender.handshake_pending
            events += sender.poll()
            if pending and not sender.handshake_pending:
                self._on_handshake_end(address, sender)
        return events

    def _on_receiver_restart(self, address: str, sender: KVSender, named: str) -> None:
        log.info(
            "the KV receiver at %s restarted (incarnation %s gone): handshaking again",
            address,
            sender.peer_incarnation[:16],
        )
        self._metrics.handshakes.labels("receiver_restarted").inc()
        self._outlive(address, sender.peer_incarnation)
        self._awaited[address] = named
        sender.forget_receiver("the receiver restarted")

    def _outlive(self, address: str, incarnation: str) -> None:
        self._outlived.setdefault(address, collections.deque(maxlen=MAX_OUTLIVED)).append(incarnation)

    def _on_handshake_end(self, address: str, sender: KVSender) -> None:
        error = sender.handshake_error
        named = self._awaited.pop(address, "")
        if error is None:
            log.info("handshake with %s: transport %s", address, sender.transport)
            outlived = self._outlived.get(address, ())
            if sender.peer_incarnation in outlived:  # it had not restarted: a job named one that is gone
                outlived.remove(sender.peer_incarnation)
            if named and named != sender.peer_incarnation:  # the job's receiver is gone
                self._outlive(address, named)
            return
        self._metrics.handshakes.labels("failed").inc()
        if error.invalid_reply:
            self._metrics.count_rejected("invalid_value")
        log.warning("handshake with %s failed: %s", address, error)
        self._failed[address] = (error, self._clock() + self._handshake_timeout_s)
        if not error.field:  # unreachable: start from a fresh socket next time
            sender.channel.close()
            del self._senders[address]

    def sockets(self) -> list[zmq.Socket]:
        return [s.channel.socket for s in self._senders.values() if s.channel.socket is not None]

    def wait_on_time(self) -> bool:
        """Some sender needs a poll soon whatever arrives (``KVSender.waits_on_time``)."""
        return any(s.waits_on_time for s in self._senders.values())

    def pinned_blocks(self) -> list[int]:
        return [b for s in self._senders.values() for b in s.pinned_blocks()]

    def close(self) -> None:
        for sender in self._senders.values():
            sender.channel.close()
        self._senders.clear()
