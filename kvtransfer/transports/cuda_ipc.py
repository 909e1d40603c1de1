"""cuda_ipc: one host, GPU pools. The receiver's pool is never exported: each transfer gets a device window
of only its own blocks, an allocation with its own IPC handle granted to the assigned sender
(kvtransfer/cuda_window.py), so nothing is mapped at handshake and the sender copies into windows."""

from __future__ import annotations

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class CudaIpc:
    name = "cuda_ipc"

    def possible(self, pair: Pair) -> bool:
        return pair.same_host and pair.pool_on_cuda and pair.sender_on_cuda

    def offer(self, exports: Exports) -> dict:
        return {}  # windows are granted per transfer (WindowGrant.cuda_window), to the assigned key only

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        return None
