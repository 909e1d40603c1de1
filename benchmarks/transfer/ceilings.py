"""Ceilings for the KV transfer benchmark (benchmarks/transfer/kv_transfer.py): the same blocks moved with
nothing of pdserve's transfer protocol around them.

``block memcpy``: a request's blocks copied from one pool into another of the same layout at the same
block ids (one strided copy, ``[L, 2, n, bs, kvh, d]``, into a preallocated pool whose pages are already
touched), the faster of torch's ``copy_`` and numpy's ``copyto``. What the one-host transports (shm,
loopback) can at best do: the same copy, without reservations, fences and a commit.

``raw zmq tuned``: the same bytes over the very sockets pdserve's zmq transport uses
(kvtransfer/channel.py: ROUTER/DEALER, the same HWM and MAXMSGSIZE, heartbeats, CURVE on or off), in
pieces of the size pdserve's sender cuts (half the credit window), each piece one multipart message
``[4-byte piece index, bytes]`` sent ``copy=False`` and landed in the destination pool; one thread polls
both ends, as the transport benchmark does. No credits, no ownership checks, no commit, no msgpack. Two
framings, the faster kept per size: ``gathered`` (a piece's blocks packed into one frame, as pdserve
sends them) and ``per_layer`` (one frame per layer and K/V, each a contiguous slice of the pool: no
packing copy at all). The existing ``raw_zmq`` baseline (plain PUSH/PULL, fresh receive buffer per
run) stays for comparison with earlier runs; it is not a ceiling.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import zmq

from kvtransfer.channel import ZmqClient, ZmqServer
from protocol.curve import ClusterKey, PlaneSecurity

FRAMINGS = ("gathered", "per_layer")


def piece_spans(num_blocks: int, piece_blocks: int) -> list[tuple[int, int]]:
    """(first block, block count) of each piece, in order."""
    return [(s, min(piece_blocks, num_blocks - s)) for s in range(0, num_blocks, piece_blocks)]


def piece_frames(pool: torch.Tensor, start: int, count: int, framing: str) -> list[np.ndarray]:
    """The frames carrying blocks ``start .. start + count - 1`` of ``pool`` ([L, 2, blocks, bs, kvh, d])."""
    blocks = pool[:, :, start : start + count]  # [L, 2, count, bs, kvh, d], strided
    if framing == "gathered":
        return [blocks.contiguous().view(torch.uint8).numpy().reshape(-1)]
    assert framing == "per_layer", framing
    return [blocks[layer, kv].view(torch.uint8).numpy().reshape(-1) for layer in range(pool.shape[0]) for kv in (0, 1)]


def land_frames(pool: torch.Tensor, start: int, count: int, frames: list, framing: str) -> None:
    """Writes a piece's frames (as ``piece_frames`` made them) into blocks ``start ..`` of ``pool``."""
    blocks = pool[:, :, start : start + count]
    with warnings.catch_warnings():  # zmq frames are read-only; we copy out of them at once
        warnings.simplefilter("ignore", UserWarning)
        if framing == "gathered":
            blocks.copy_(torch.frombuffer(frames[0], dtype=pool.dtype).view(blocks.shape))
            return
        for i, frame in enumerate(frames):
            target = blocks[i // 2, i % 2]  # [count, bs, kvh, d], contiguous
            target.copy_(torch.frombuffer(frame, dtype=pool.dtype).view(target.shape))


class RawZmqPair:
    """A sender and a receiver on pdserve's zmq channel sockets, CURVE as ``curve`` says."""

    def __init__(self, max_msg_size: int, curve: bool):
        key = ClusterKey.from_secret(bytes(32)) if curve else None
        self.ctx = zmq.Context()
        self.server = ZmqServer(self.ctx, "127.0.0.1", max_msg_size=max_msg_size, security=PlaneSecurity(key))
        self.client = ZmqClient(self.ctx, self.server.endpoint, security=PlaneSecurity(key))

    def transfer(self, src: torch.Tensor, dst: torch.Tensor, num_blocks: int, piece_blocks: int, framing: str) -> int:
        """Moves blocks 0 .. num_blocks - 1 of ``src`` into ``dst``; returns the payload bytes sent."""
        spans = piece_spans(num_blocks, piece_blocks)
        sent, landed, payload = 0, 0, 0
        in_flight = []  # frames zmq still reads (copy=False)
        while landed < len(spans):
            while sent < len(spans):
                frames = piece_frames(src, *spans[sent], framing)
                if not self.client.send([sent.to_bytes(4, "little"), *frames]):
                    break  # the queue is full (HWM) or not connected yet: land some first
                in_flight.append(frames)
                payload += sum(f.nbytes for f in frames)
                sent += 1
            message = self.server.recv()
            if message is None:
                continue
            _, frames, _ = message
            land_frames(dst, *spans[int.from_bytes(frames[0], "little")], frames[1:], framing)
            landed += 1
        return payload

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.server.close_security()
        self.ctx.destroy(linger=0)


def time_raw_zmq_tuned(
    src: torch.Tensor, dst: torch.Tensor, sizes_blocks: list[int], piece_blocks: int, repeats: int, pair: RawZmqPair
) -> dict[int, tuple[float, str]]:
    """Seconds per transfer (best of ``repeats`` and of the framings) and the framing that gave it; closes
    ``pair``."""
    results = {}
    try:
        pair.transfer(src, dst, 1, piece_blocks, "gathered")  # connect (and the CURVE handshake) untimed
        for n in sizes_blocks:
            best = (float("inf"), "")
            for framing in FRAMINGS:
                for _ in range(repeats):
                    dst[:, :, :n].zero_()
                    start = time.perf_counter()
                    pair.transfer(src, dst, n, piece_blocks, framing)
                    best = min(best, (time.perf_counter() - start, framing))
                    assert torch.equal(dst[:, :, :n], src[:, :, :n])  # the bytes really moved
            results[n] = best
    finally:
        pair.close()
    return results


def time_block_memcpy(src: torch.Tensor, dst: torch.Tensor, sizes_blocks: list[int], repeats: int) -> dict[int, float]:
    """Seconds to copy blocks 0 .. n - 1 of ``src`` into ``dst`` (same layout, both preallocated and
    touched), the faster of torch and numpy, best of ``repeats``."""
    dst.copy_(src)  # first touch of every page of dst is not a copy cost
    results = {}
    for n in sizes_blocks:
        s, d = src[:, :, :n], dst[:, :, :n]
        s_np, d_np = s.numpy(), d.numpy()
        best = float("inf")
        for copy in (lambda: d.copy_(s), lambda: np.copyto(d_np, s_np)):
            for _ in range(repeats):
                start = time.perf_counter()
                copy()
                best = min(best, time.perf_counter() - start)
        results[n] = best
    return results
