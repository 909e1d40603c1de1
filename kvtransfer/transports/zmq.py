"""zmq: any two hosts; each write's block bytes ride the channel beside its header, and the receiver
scatters them into its pool. Always possible: the fallback of every pair."""

from __future__ import annotations

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class Zmq:
    name = "zmq"

    def possible(self, pair: Pair) -> bool:
        return True

    def offer(self, exports: Exports) -> dict:
        return {}

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        return None
