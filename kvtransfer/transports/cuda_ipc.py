"""cuda_ipc: one host, GPU pools; the receiver exports its pool once as a CUDA IPC handle, the sender maps
it (kvtransfer/cuda_ipc.py) and the fence from /dev/shm."""

from __future__ import annotations

import torch

from kvtransfer.channel import ClientChannel
from kvtransfer.cuda_ipc import import_pool
from kvtransfer.pool import PoolLayout
from kvtransfer.shm_pool import attach_shared
from protocol.kv_messages import HandshakeReply

from .base import DirectTarget, Exports, Pair


class CudaIpc:
    name = "cuda_ipc"

    def possible(self, pair: Pair) -> bool:
        return pair.same_host and pair.pool_on_cuda and pair.sender_on_cuda

    def offer(self, exports: Exports) -> dict:
        return {"shm_fence_name": exports.fence_name, "cuda_pool": exports.cuda_pool()}

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        fence = attach_shared(reply.shm_fence_name, (layout.num_blocks,), torch.int64).tensor
        return import_pool(reply.cuda_pool, layout.shape, layout.dtype), fence
