"""shm: one host, CPU pools. The receiver's pool is never handed out: each transfer gets a /dev/shm window
of only its own blocks, granted to the assigned sender (kvtransfer/shm_window.py), so nothing is mapped at
handshake and the sender copies into windows rather than into the pool."""

from __future__ import annotations

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class Shm:
    name = "shm"

    def possible(self, pair: Pair) -> bool:
        return pair.same_host and pair.pool_in_shm and not pair.pool_on_cuda

    def offer(self, exports: Exports) -> dict:
        return {}  # windows are granted per transfer (WindowGrant), to the assigned key only

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        return None
