"""shm: one host, CPU pools; the receiver's pool and fence live in /dev/shm and the sender maps both."""

from __future__ import annotations

import torch

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from kvtransfer.shm_pool import attach_shared
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class Shm:
    name = "shm"

    def possible(self, pair: Pair) -> bool:
        return pair.same_host and pair.pool_in_shm and not pair.pool_on_cuda

    def offer(self, exports: Exports) -> dict:
        return {"shm_pool_name": exports.shm_pool_name, "shm_fence_name": exports.fence_name}

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        fence = attach_shared(reply.shm_fence_name, (layout.num_blocks,), torch.int64).tensor
        return attach_shared(reply.shm_pool_name, layout.shape, layout.dtype).tensor, fence
