"""loopback: sender and receiver in one process (tests, a single-process node); the sender copies
straight into the receiver's pool tensor."""

from __future__ import annotations

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class Loopback:
    name = "loopback"

    def possible(self, pair: Pair) -> bool:
        return pair.has_loopback

    def offer(self, exports: Exports) -> dict:
        return {}

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        target = channel.loopback_target()
        assert target is not None, "loopback chosen over a channel that leaves the process"
        return target
