"""What every KV transport is (``Transport``): how the blocks of one sender/receiver pair travel.

At handshake the receiver picks, in the sender's order of preference, the first transport the pair can
use (``possible``) and puts in its reply what the sender needs to reach its pool (``offer``); the sender
then ``attach``es. A direct transport (loopback only) gives the sender the receiver's pool and fence to copy
into (each write still fenced per block); shm and cuda_ipc grant a window per transfer instead; zmq sends
the blocks' bytes over the channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from kvtransfer.channel import ClientChannel
from kvtransfer.pool import PoolLayout
from protocol.kv_messages import HandshakeReply

DirectTarget = tuple[torch.Tensor, torch.Tensor]  # (the receiver's pool, its fence), mapped in the sender


@dataclass(frozen=True, slots=True)
class Pair:
    """What decides which transports one sender and one receiver can use (the receiver's view)."""

    same_host: bool  # the sender's hostname is ours
    has_loopback: bool  # an in-process channel: the sender lives in our process
    pool_on_cuda: bool  # our pool is on a GPU
    pool_in_shm: bool  # our pool lives in /dev/shm
    sender_on_cuda: bool  # the sender's pool is on a GPU (it sent its device)


@dataclass(frozen=True, slots=True)
class Exports:
    """What a receiver can hand a sender to reach its pool."""

    shm_pool_name: str | None  # the pool's /dev/shm file, when it lives there
    fence_name: str  # the fence's /dev/shm file (always shared memory)


class Transport(Protocol):
    name: ClassVar[str]  # as offered in Handshake.transports and chosen in HandshakeReply.transport

    def possible(self, pair: Pair) -> bool:
        """Receiver side, at handshake: this pair can use it."""
        ...

    def offer(self, exports: Exports) -> dict:
        """Receiver side: the HandshakeReply fields the sender needs to reach our pool."""
        ...

    def attach(self, reply: HandshakeReply, layout: PoolLayout, channel: ClientChannel) -> DirectTarget | None:
        """Sender side: the receiver's pool and fence to copy into; None: the bytes go over the channel."""
        ...
