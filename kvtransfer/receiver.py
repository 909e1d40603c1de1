"""Decode-node side of the transfer plane: owns destination ranges and applies incoming writes.

Life of one transfer on the receiver:
1. the decode node reserves the range (``reserve``): blocks leave its free list, fences show the token;
2. the sender handshakes once per incarnation (compat checked, transport chosen);
3. each ``BlockWrite`` is checked against the ownership table, then applied (inline bytes scattered
   into the pool) or just recorded (the sender already copied them); a ``Credit`` goes back either way;
4. ``Commit`` checks every reserved block was written -> event(ok, first token); the node ``adopt``s;
5. otherwise abort or lease expiry hands the blocks back through ``release`` -> event(not ok).

Who may write: a range reserved with a ``sender_key`` (the CURVE public key of the prefill worker the
gateway assigned, protocol/curve.py) takes writes, its commit and its abort only from a connection
authenticated with that key; anyone else's frames for it are refused (``not_assigned``), so a cluster
member that was not given the request cannot put KV into it, nor into the prefix cache through it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable

import torch

from kernels import scatter_blocks
from kvtransfer import fence as fences
from kvtransfer.channel import ServerChannel
from kvtransfer.compat import compat_of, describe_mismatch, first_mismatch, new_incarnation
from kvtransfer.cuda_window import cuda_windows
from kvtransfer.events import TransferEvent
from kvtransfer.metrics import TransferMetrics
from kvtransfer.ownership import DEFAULT_LEASE_S, OwnershipTable, RangeState, Verdict
from kvtransfer.pool import BlockPool
from kvtransfer.shm_pool import SharedTensor, ShmCapacityError, create_shared
from kvtransfer.shm_window import ShmWindows
from kvtransfer.transports import FALLBACK, TRANSPORTS, Exports, Pair
from kvtransfer.window_arena import WindowCapacityError
from protocol.codec import WireError, decode, encode
from protocol.kv_messages import (
    Abort,
    BlockWrite,
    Commit,
    CommitAck,
    Credit,
    Handshake,
    HandshakeReply,
    WindowRelease,
    WindowRequest,
    WriteRejected,
)
from protocol.rejects import RejectLog

MAX_HEADER_BYTES = 64 * 1024
WINDOWED = ("shm", "cuda_ipc")  # transports whose senders write into per-transfer windows, never the pool
log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        pool: BlockPool,
        model: str,
        channel: ServerChannel,
        release: Callable[[list[int]], None],
        metrics: TransferMetrics,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        credits: int = 256,
        shm_pool_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        rejects: RejectLog | None = None,
    ):
        self.pool = pool
        self.rejects = rejects or RejectLog(log, metrics.count_rejected)
        self.compat = compat_of(model, pool.layout)
        self.incarnation = new_incarnation()
        self.channel = channel
        self.metrics = metrics
        self.credits = credits
        self.shm_pool_name = shm_pool_name  # set when pool.tensor lives in /dev/shm
        self._user_release = release
        self._clock = clock
        self.table = OwnershipTable(self._release, clock=clock, lease_s=lease_s)
        # The fence is always shared memory: shm and cuda_ipc senders in other processes read it.
        self._fence: SharedTensor = create_shared(
            (pool.layout.num_blocks,), torch.int64, prefix=f"fence-{os.getpid()}"
        )  # pid: a supervisor cleans up after us
        self._peer_of: dict[bytes, str] = {}  # channel peer id -> sender incarnation
        self._key_of: dict[bytes, str] = {}  # channel peer id -> its public key at handshake
        self._transport_of: dict[str, str] = {}  # sender incarnation -> transport
        self._events: list[TransferEvent] = []
        # shm / cuda_ipc (whichever the pool's memory allows): one window of only its blocks per transfer
        tensor = pool.tensor
        self.windows = cuda_windows(pool.layout, tensor.device.index) if tensor.is_cuda else ShmWindows(pool.layout)
        # True for an in-process channel: a loopback sender copies straight into our pool.
        self._has_loopback = channel.offer_loopback(pool.tensor, self._fence.tensor)

    # -- decode-node calls -------------------------------------------------------------------
    def reserve(
        self,
        rid: str,
        generation: int,
        block_ids: list[int],
        sender_incarnation: str | None = None,
        sender_key: str = "",
    ):
        """``sender_key``: only the peer authenticated with this key may write the range ("": any peer,
        only where peers are not authenticated: on a CURVE plane a range for anyone is refused)."""
        if self.needs_sender_key and not sender_key:
            raise ValueError(f"reservation {rid!r} names no sender key on an authenticated plane")
        self.table.reserve(rid, generation, block_ids, sender_incarnation, sender_key=sender_key)
        self._fence.tensor[torch.tensor(block_ids)] = fences.fence_token(rid, generation)
        self.metrics.blocks_held_for_peer.set(len(self.table.held_blocks()))

    @property
    def needs_sender_key(self) -> bool:
        """On a CURVE plane every range names the one peer key that may write it."""
        return self.channel.authenticates_peers

    def adopt(self, rid: str) -> tuple[int, ...]:
        """After a committed event: the request takes the blocks over; the fence comes down."""
        ids = self.table.adopt(rid)
        self._fence.tensor[torch.tensor(ids)] = fences.FREE
        self.metrics.blocks_held_for_peer.set(len(self.table.held_blocks()))
        return ids

    def abort(self, rid: str) -> bool:
        """Local abort (client gone). Idempotent; the blocks go back through ``release``."""
        self.windows.drop(rid)
        return self.table.abort(rid)

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        for _ in range(max_messages):
            message = self.channel.recv()
            if message is None:
                break
            try:
                self._handle(*message)
            except Exception as exc:  # one bad message must not take the node down
                self.rejects.reject("handler_error", message[2] or message[0].hex(), repr(exc), exc_info=True)
        for r in self.table.expire():
            self.metrics.expired_leases.inc()
            self._fail(r.rid, r.generation, "lease expired", r.block_ids)
        for rid in self.windows.expire():  # cuda_ipc: its sender never said it unmapped it: freed, not reused
            self.metrics.unreleased_windows.inc()
            log.warning("the window of %s was never released by its sender: freed, not reused", rid[:64])
        events, self._events = self._events, []
        return events

    @property
    def fence_name(self) -> str:
        """The /dev/shm file of the fence; a supervisor unlinks it if this process dies."""
        return self._fence.name

    def close(self) -> None:
        self.channel.close()
        self._fence.unlink()
        self.windows.drop_all()

    # -- frames ------------------------------------------------------------------------------
    def _handle(self, peer: bytes, frames: list, key: str = "") -> None:
        try:
            if not frames:
                raise WireError("empty message")
            record = decode(frames[0], MAX_HEADER_BYTES)
            if len(frames) != (2 if isinstance(record, BlockWrite) and record.inline else 1):
                raise WireError(f"{type(record).__name__} with {len(frames)} frames")
            if not isinstance(record, (Handshake, BlockWrite, Commit, Abort, WindowRequest, WindowRelease)):
                raise WireError(f"{type(record).__name__} is not a sender's message")
        except WireError as exc:
            self.metrics.malformed_frames.inc()
            self.rejects.reject("malformed", key or peer.hex(), str(exc))
            return
        if isinstance(record, Handshake):
            self._on_handshake(peer, record, key)
        elif self._peer_of.get(peer) != record.sender_incarnation:
            self._reject(peer, record, Verdict.UNKNOWN_INCARNATION)  # no handshake, or spoofed incarnation
        elif isinstance(record, WindowRequest):
            self._on_window_request(peer, record)
        elif isinstance(record, WindowRelease):
            key = self._key_of.get(peer, "")
            if not self.windows.release(record.rid, record.generation, key):
                detail = f"release of no window of its: {record.rid[:64]}"
                self.rejects.reject("invalid_value", key or peer.hex(), detail)
        elif isinstance(record, BlockWrite):
            self._on_write(peer, record, frames)
        elif isinstance(record, Commit):
            self._on_commit(peer, record)
        elif isinstance(record, Abort):
            r = self.table.get(record.rid)
            # Once committed the range is the decode node's (a "committed" event may already be on its
            # way to it): a sender's abort arriving after its own commit has nothing left to abort.
            live = r is not None and r.state != RangeState.COMMITTED
            if live and r.sender_key and r.sender_key != self._key_of.get(peer):
                self.rejects.reject("not_assigned", self._key_of.get(peer, ""), f"abort of {record.rid[:64]}")
            elif (
                live
                and r.sender_incarnation in (None, record.sender_incarnation)
                and self.table.abort(record.rid, record.generation)
            ):
                self._fail(record.rid, record.generation, f"aborted by sender: {record.reason}", r.block_ids)

    def _on_handshake(self, peer: bytes, hs: Handshake, key: str = "") -> None:
        field = first_mismatch(self.compat, hs.compat)
        if field is not None:
            self.metrics.handshakes.labels("refused").inc()
            reply = HandshakeReply(
                False,
                self.incarnation,
                "",
                0,
                self.pool.layout.num_blocks,
                error=describe_mismatch(self.compat, hs.compat, field),
                mismatched_field=field,
            )
            self.channel.send(peer, [encode(reply)])
            return
        old = self._peer_of.get(peer)
        if old is not None and old != hs.sender_incarnation:  # the sender restarted: its old work is void
            for r in self.table.forget_peer(old):
                self._fail(r.rid, r.generation, "sender restarted", r.block_ids)
        self._peer_of[peer] = hs.sender_incarnation
        self._key_of[peer] = key
        self.table.register_peer(hs.sender_incarnation)
        transport = self._choose_transport(hs)
        self._transport_of[hs.sender_incarnation] = transport
        exports = Exports(self.shm_pool_name, self._fence.name)
        reply = HandshakeReply(
            True,
            self.incarnation,
            transport,
            self.credits,
            self.pool.layout.num_blocks,
            **TRANSPORTS[transport].offer(exports),
        )
        self.metrics.handshakes.labels("accepted").inc()
        self.channel.send(peer, [encode(reply)])

    def _choose_transport(self, hs: Handshake) -> str:
        """The first of the sender's offers this pair can use (kvtransfer/transports/)."""
        pair = Pair(
            same_host=hs.hostname == socket.gethostname(),
            has_loopback=self._has_loopback,
            pool_on_cuda=self.pool.tensor.is_cuda,
            pool_in_shm=self.shm_pool_name is not None,
            sender_on_cuda=hs.cuda_device is not None,
        )
        return next((t for t in hs.transports if t in TRANSPORTS and TRANSPORTS[t].possible(pair)), FALLBACK)

    def _on_window_request(self, peer: bytes, req: WindowRequest) -> None:
        """shm, cuda_ipc: a window of the reservation's blocks, granted only to the key the range was reserved for."""
        key = self._key_of.get(peer, "")
        if self._transport_of.get(req.sender_incarnation) not in WINDOWED:
            self.rejects.reject("invalid_value", key or peer.hex(), "window request outside shm and cuda_ipc")
            self._reject(peer, req, Verdict.WRONG_STATE)
            return
        verdict = self.table.write(req.rid, req.generation, req.sender_incarnation, [], key=key)
        if verdict is not Verdict.OK:
            self._reject(peer, req, verdict)
            return
        r = self.table.get(req.rid)
        try:
            grant = self.windows.open(req.rid, req.generation, r.block_ids, key)
        except (ShmCapacityError, WindowCapacityError) as exc:  # no memory for it: this transfer cannot land
            self.table.abort(req.rid, req.generation)
            transport = self._transport_of[req.sender_incarnation]
            self._fail(req.rid, req.generation, f"no {transport} window: {exc}", r.block_ids)
            self._reject(peer, req, Verdict.STALE)
            return
        self.channel.send(peer, [encode(grant)])

    def _on_write(self, peer: bytes, w: BlockWrite, frames: list) -> None:
        n = len(w.dst_block_ids)
        expected = n * self.pool.layout.bytes_per_block
        self.channel.send(peer, [encode(Credit(w.rid, w.generation, n))])  # the sender spent n credits
        if w.inline and (w.num_bytes != expected or len(frames[1]) != expected):
            self.metrics.malformed_frames.inc()
            self._reject(peer, w, Verdict.OUT_OF_RANGE)
            return
        verdict = self.table.write(
            w.rid, w.generation, w.sender_incarnation, w.dst_block_ids, key=self._key_of.get(peer, "")
        )
        if verdict is Verdict.OK and w.inline:
            layout = self.pool.layout
            with warnings.catch_warnings():  # zmq frames are read-only; we copy out of them at once
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(frames[1], dtype=layout.dtype)
            shape = (layout.num_layers, 2, n, *layout.shape[3:])  # int8 rows carry their scales
            dst = torch.tensor(w.dst_block_ids, device=self.pool.tensor.device)
            scatter_blocks(self.pool.tensor, dst, data.view(shape).to(self.pool.tensor.device))
        elif (
            verdict is Verdict.OK
            and self._transport_of.get(w.sender_incarnation) in WINDOWED
            # the bytes wait in the transfer's window; only now, checked, do they reach the pool
            and not self.windows.copy_in(w.rid, w.generation, w.dst_block_ids, self.pool.tensor)
        ):
            # Counted as written but never copied: the range must not commit. End it here.
            r = self.table.get(w.rid)
            self.table.abort(w.rid, w.generation)
            self._fail(w.rid, w.generation, "write without a window", r.block_ids)
            verdict = Verdict.WRONG_STATE
        if verdict is not Verdict.OK:
            self._reject(peer, w, verdict)

    def _on_commit(self, peer: bytes, c: Commit) -> None:
        verdict = self.table.commit(c.rid, c.generation, c.sender_incarnation, key=self._key_of.get(peer, ""))
        r = self.table.get(c.rid)
        if verdict is Verdict.INCOMPLETE:  # a sender bug: never let a half-written range decode
            self.table.abort(c.rid, c.generation)
            self._fail(c.rid, c.generation, "commit before every block was written", r.block_ids)
        elif verdict is Verdict.OK and r.state == RangeState.COMMITTED:
            self.windows.drop(c.rid)
            num_bytes = len(r.block_ids) * self.pool.layout.bytes_per_block
            started = r.first_write_at if r.first_write_at is not None else r.reserved_at
            transport = self._transport_of.get(c.sender_incarnation, FALLBACK)
            self.metrics.observe_transfer(transport, num_bytes, max(self._clock() - started, 0.0))
            self._events.append(TransferEvent(c.rid, c.generation, True, commit=c, block_ids=r.block_ids))
        if verdict is not Verdict.OK:
            self.metrics.rejected_writes.labels(verdict.value).inc()
        if verdict is Verdict.NOT_ASSIGNED:
            self.rejects.reject("not_assigned", self._key_of.get(peer, ""), f"commit of {c.rid[:64]}")
        self.channel.send(peer, [encode(CommitAck(c.rid, c.generation, verdict is Verdict.OK, verdict.value))])

    def _reject(self, peer: bytes, record, verdict: Verdict) -> None:
        self.metrics.rejected_writes.labels(verdict.value).inc()
        if verdict is Verdict.NOT_ASSIGNED:
            self.rejects.reject("not_assigned", self._key_of.get(peer, ""), f"write for {record.rid[:64]}")
        self.channel.send(peer, [encode(WriteRejected(record.rid, record.generation, verdict.value))])

    def _fail(self, rid: str, generation: int, reason: str, block_ids) -> None:
        self.windows.drop(rid, generation)
        self.metrics.failed_transfers.labels("receiver", reason.split(":")[0]).inc()
        self._events.append(TransferEvent(rid, generation, False, reason, block_ids=tuple(block_ids)))

    def _release(self, block_ids: list[int]) -> None:
        self._fence.tensor[torch.tensor(block_ids)] = fences.FREE  # before anyone can reuse them
        self._user_release(block_ids)
        self.metrics.blocks_held_for_peer.set(len(self.table.held_blocks()))  # already without these
