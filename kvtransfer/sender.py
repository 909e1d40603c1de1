"""Prefill-node side of the transfer plane: ships finished blocks per prefill chunk, then commits.

Life of one transfer on the sender:
1. ``handshake`` once per receiver incarnation: compat checked, transport chosen by the receiver;
2. ``send(rid, gen, src, dst)`` after each prefill chunk: source blocks are pinned, split in pieces
   that fit the receiver's credit window, shipped only while credits last;
3. ``commit`` after the last chunk (with the first sampled token) goes out behind the last piece;
4. each ``Credit`` unpins its piece and renews the deadline; ``CommitAck`` ends the transfer;
5. a silent receiver past the deadline, a ``WriteRejected`` or a failed fence check fails it:
   every block it pinned is unpinned at once. Nothing is pinned for a receiver that is gone.
"""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import gather_blocks
from kvtransfer import cuda_ipc
from kvtransfer import fence as fences
from kvtransfer.block_runs import copy_blocks
from kvtransfer.channel import ClientChannel
from kvtransfer.compat import compat_of, new_incarnation
from kvtransfer.copy_timing import CopyStopwatch, TransferTimes, block_bytes
from kvtransfer.cuda_window import view_window
from kvtransfer.events import TransferEvent, TransferStatus
from kvtransfer.metrics import TransferMetrics
from kvtransfer.ownership import Verdict
from kvtransfer.pool import BlockPool
from kvtransfer.shm_window import attach_window
from kvtransfer.transports import TRANSPORTS, DirectTarget
from protocol.codec import WireError, decode, encode
from protocol.kv_messages import (
    Abort,
    BlockWrite,
    Commit,
    CommitAck,
    Credit,
    Handshake,
    HandshakeReply,
    WindowGrant,
    WindowRelease,
    WindowRequest,
    WriteRejected,
)

DEFAULT_DEADLINE_S = 30.0
MAX_FINISHED = 4096
MAX_CREDITS = 1 << 16  # blocks in flight a receiver may grant; more is a hostile or broken reply


class HandshakeError(RuntimeError):
    def __init__(self, message: str, field: str = "", invalid_reply: bool = False):
        super().__init__(message)
        self.field = field  # the compatibility field that differs, when that was the reason
        self.invalid_reply = invalid_reply  # the receiver answered values we cannot use: a hostile or broken peer


@dataclass(slots=True)
class _Transfer:
    rid: str
    generation: int
    deadline: float
    status: TransferStatus = TransferStatus.PENDING
    queued: collections.deque = field(default_factory=collections.deque)  # (src ids, dst ids) pieces
    in_flight: collections.deque = field(default_factory=collections.deque)  # (src ids, buffer kept alive)
    commit: Commit | None = None
    commit_sent: bool = False
    times: TransferTimes = field(default_factory=TransferTimes)  # copy, exposed tail, span (copy_timing.py)
    # shm / cuda_ipc: the window of only this transfer's blocks (kvtransfer/shm_window.py, cuda_window.py)
    window_asked: bool = False
    window: torch.Tensor | None = None
    mapping: cuda_ipc.DeviceBuffer | None = None  # cuda_ipc: the window's mapping, closed (and released) at the end
    slot_of: dict[int, int] = field(default_factory=dict)  # reserved block id -> its slot in the window


class KVSender:
    def __init__(
        self,
        pool: BlockPool,
        model: str,
        channel: ClientChannel,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        transports: tuple[str, ...] = tuple(TRANSPORTS),
        unpin: Callable[[list[int]], None] | None = None,
        metrics: TransferMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.compat = compat_of(model, pool.layout)
        self.incarnation = new_incarnation()
        self.channel = channel
        self.deadline_s = deadline_s
        self.transports = transports
        self._unpin = unpin or (lambda block_ids: None)
        self._metrics = metrics
        # True until a handshake succeeds, and again once the receiver no longer knows us (it restarted).
        self.needs_handshake = True
        self.handshake_error: HandshakeError | None = None  # why the last handshake failed
        self._handshake_give_up: float | None = None  # set while a handshake is in flight
        self._handshake_sent = False
        self._handshake_reply: HandshakeReply | None = None
        self._clock = clock
        self.transport = ""  # chosen at handshake
        self.peer_num_blocks = 0  # the receiver's pool: destination block ids are below it
        self.peer_incarnation = ""
        self._credits = 0
        self._window = 0
        self._target: DirectTarget | None = None  # direct transports: (the receiver's pool, its fence)
        self._windowed = False  # shm, cuda_ipc: each transfer writes into a window of its own blocks only
        self._transfers: dict[str, _Transfer] = {}  # live transfers only
        self._finished: collections.OrderedDict[str, TransferStatus] = collections.OrderedDict()
        self._events: list[TransferEvent] = []

    # -- handshake ---------------------------------------------------------------------------
    def start_handshake(self, timeout_s: float = 10.0) -> None:
        """Offer a Handshake without waiting for the answer: ``poll`` takes the reply (or gives up
        after ``timeout_s``), so a prefill loop keeps running while a receiver is slow or gone."""
        self.handshake_error = None
        self._handshake_give_up = self._clock() + timeout_s
        self._handshake_sent = False
        self._offer_handshake()

    @property
    def handshake_pending(self) -> bool:
        return self._handshake_give_up is not None

    def handshake(self, timeout_s: float = 10.0) -> HandshakeReply:
        """Blocking form of ``start_handshake`` + ``poll``, for tools and tests."""
        self.start_handshake(timeout_s)
        while self.handshake_pending:
            self.poll()
            time.sleep(0.001)
        if self.handshake_error is not None:
            raise self.handshake_error
        return self._handshake_reply

    def _offer_handshake(self) -> None:
        if not self._handshake_sent:
            device = self.pool.tensor.device.index if self.pool.tensor.is_cuda else None
            hs = Handshake(self.compat, self.incarnation, socket.gethostname(), list(self.transports), device)
            self._handshake_sent = self.channel.send([encode(hs)])
        if self._clock() > self._handshake_give_up:
            self._end_handshake(
                HandshakeError("no handshake reply" if self._handshake_sent else "receiver not reachable")
            )

    def _on_handshake_reply(self, reply: HandshakeReply) -> None:
        if not self._handshake_sent:
            return  # a reply to an earlier conversation, queued ahead of ours
        if not reply.accepted:
            self._end_handshake(HandshakeError(reply.error, reply.mismatched_field))
            return
        error = self._reply_error(reply)
        if not error:
            try:
                self._attach(reply)
            except (ValueError, OSError, RuntimeError) as exc:  # a name that is not there, a size that differs
                error = f"cannot map the receiver's pool: {str(exc)[:200]}"
        if error:
            self._end_handshake(HandshakeError(f"invalid handshake reply: {error}", invalid_reply=True))
            return
        self.transport, self.peer_incarnation = reply.transport, reply.receiver_incarnation
        self._credits = self._window = reply.credits
        self.needs_handshake = False
        self._handshake_reply = reply
        self._end_handshake(None)

    def _end_handshake(self, error: HandshakeError | None) -> None:
        self.handshake_error = error
        self._handshake_give_up = None

    def _reply_error(self, reply: HandshakeReply) -> str:
        """Why an accepted reply cannot be used ("" when it can): the receiver is a peer, not trusted."""
        if reply.transport not in self.transports:
            return f"transport {reply.transport[:40]!r} was not offered"
        if reply.transport == "loopback" and self.channel.loopback_target() is None:
            return "loopback outside one process"
        if not 1 <= reply.credits <= MAX_CREDITS:
            return f"credits {reply.credits} outside [1, {MAX_CREDITS}]"
        if reply.transport == "loopback" and reply.num_blocks != self.pool.layout.num_blocks:
            return f"pool of {reply.num_blocks} blocks, expected {self.pool.layout.num_blocks}"
        if reply.transport == "cuda_ipc" and not self.pool.tensor.is_cuda:
            return "cuda_ipc for a pool that is not on a GPU"
        if reply.num_blocks < 1:
            return f"pool of {reply.num_blocks} blocks"
        return ""

    def _attach(self, reply: HandshakeReply) -> None:
        layout = self.pool.layout
        transport = TRANSPORTS.get(reply.transport)
        assert transport is not None, reply.transport
        self._target = transport.attach(reply, layout, self.channel)
        self._windowed = reply.transport in ("shm", "cuda_ipc")
        assert reply.num_blocks == layout.num_blocks or self._target is None
        self.peer_num_blocks = reply.num_blocks

    # -- prefill-node calls --------------------------------------------------------------------
    def send(self, rid: str, generation: int, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Queue one chunk's blocks (only those the receiver lacks). Pins ``src_block_ids``."""
        assert len(src_block_ids) == len(dst_block_ids) and self._window > 0, "handshake first"
        t = self._transfers.get(rid)
        if t is not None and t.generation != generation:
            self._finish(t, False, f"superseded by generation {generation}")  # unpins the old attempt
        if t is None or t.generation != generation:
            t = self._transfers[rid] = _Transfer(rid, generation, self._clock() + self.deadline_s)
            t.times.started_at = time.perf_counter()
        assert t.commit is None, f"{rid} is already committing"
        # Pieces of half a window: two are in flight at once, so the receiver's copy of one overlaps
        # the wire time of the next (a whole-window piece would wait for its own credit).
        piece = max(1, self._window // 2)
        for start in range(0, len(src_block_ids), piece):
            t.queued.append((src_block_ids[start : start + piece], dst_block_ids[start : start + piece]))

    def commit(
        self,
        rid: str,
        generation: int,
        first_token: int | None = None,
        first_logprob: float | None = None,
        top_token_ids: list[int] | None = None,
        top_logprobs: list[float] | None = None,
        lora_name: str = "",
        lora_digest: str = "",
    ) -> bool:
        """Queue the commit behind the transfer's last piece. False when the transfer already ended
        (its failure event says why)."""
        t = self._transfers.get(rid)
        if t is None or t.generation != generation:
            return False
        t.commit = Commit(
            rid,
            generation,
            self.incarnation,
            first_token,
            first_logprob,
            list(top_token_ids or []),
            list(top_logprobs or []),
            lora_name,
            lora_digest,
        )
        t.times.commit_at = time.perf_counter()
        return True

    def abort(self, rid: str, generation: int, reason: str = "") -> None:
        """Idempotent. Unpins at once; tells the receiver so it frees the range before the lease runs out."""
        self.channel.send([encode(Abort(rid, generation, self.incarnation, reason))])
        t = self._transfers.get(rid)
        if t is not None and t.generation == generation:
            self._finish(t, False, f"aborted: {reason}")

    def forget_receiver(self, reason: str) -> None:
        """The receiver restarted (a new incarnation at the same address): transfers to the old one
        cannot land, so they fail now (unpinned); the next handshake attaches the new one."""
        for t in list(self._transfers.values()):
            self._finish(t, False, reason)
        self.needs_handshake = True
        self._target = None

    def status(self, rid: str) -> TransferStatus | None:
        t = self._transfers.get(rid)
        return t.status if t is not None else self._finished.get(rid)

    @property
    def waits_on_time(self) -> bool:
        """Something only a later ``poll`` moves, not a reply: a message the socket refused (receiver not
        connected yet, or its queue full) while the credits allow it, or an in-process channel."""
        if self.channel.socket is None:
            return True
        if self.handshake_pending and not self._handshake_sent:
            return True
        return any(
            (t.queued and self._credits >= len(t.queued[0][0]) and not self._awaits_window(t))
            or (not t.queued and t.commit is not None and not t.commit_sent)
            for t in self._transfers.values()
        )

    def pinned_blocks(self) -> list[int]:
        pinned = []
        for t in self._transfers.values():
            pinned += [b for src, _ in t.in_flight for b in src] + [b for src, _ in t.queued for b in src]
        return pinned

    def poll(self) -> list[TransferEvent]:
        while (frames := self.channel.recv()) is not None:
            self._on_message(frames)
        if self.handshake_pending:
            self._offer_handshake()
        now = self._clock()
        for t in list(self._transfers.values()):
            if now >= t.deadline:
                self._finish(t, False, "receiver silent past deadline")
                continue
            self._pump(t)
        events, self._events = self._events, []
        return events

    # -- internals ---------------------------------------------------------------------------
    def _awaits_window(self, t: _Transfer) -> bool:
        return self._windowed and t.window is None and t.window_asked

    def _pump(self, t: _Transfer) -> None:
        if self._windowed and t.window is None and t.queued:
            if not t.window_asked:
                t.window_asked = self.channel.send([encode(WindowRequest(t.rid, t.generation, self.incarnation))])
            return  # nothing ships before the grant; the commit waits behind the pieces
        while t.queued and self._credits >= len(t.queued[0][0]):
            src, dst = t.queued[0]
            header, frames, keep = self._ship(t, src, dst)
            if header is None:
                return
            if not self.channel.send([encode(header), *frames]):
                return  # receiver's queue is full or not connected: retry on the next poll
            t.queued.popleft()
            t.in_flight.append((src, keep))
            self._credits -= len(src)
            t.status = TransferStatus.TRANSFERRING
        if not t.queued and t.commit is not None and not t.commit_sent:
            t.commit_sent = self.channel.send([encode(t.commit)])

    def _ship(self, t: _Transfer, src: list[int], dst: list[int]):
        if self._windowed:
            slots = [t.slot_of.get(d) for d in dst]
            if None in slots:
                self._finish(t, False, "destination outside the granted window")
                return None, None, None
            with (watch := CopyStopwatch(self.pool.tensor.device)):
                copy_blocks(self.pool.tensor, src, t.window, slots)
            if t.window.is_cuda:
                torch.cuda.current_stream(t.window.device).synchronize()  # bytes land before the header
            self._copied(t, watch, len(src))
            return BlockWrite(t.rid, t.generation, self.incarnation, dst, False, 0), [], None
        if self._target is None:  # over the channel: packed raw bytes ride beside the header, zero-copy
            src_ids = torch.tensor(src, device=self.pool.tensor.device)
            with (watch := CopyStopwatch(self.pool.tensor.device)):
                buffer = gather_blocks(self.pool.tensor, src_ids)  # [L, 2, n, bs, kvh, d]
                raw = buffer.contiguous().view(torch.uint8).cpu()
            self._copied(t, watch, len(src))
            header = BlockWrite(t.rid, t.generation, self.incarnation, dst, True, raw.numel())
            return header, [memoryview(raw.numpy()).cast("B")], raw
        remote, fence = self._target
        dst_ids = torch.tensor(dst)
        if not fences.holds(fence, dst_ids, fences.fence_token(t.rid, t.generation)):
            self._finish(t, False, "stale: destination no longer reserved for this transfer", released=True)
            return None, None, None
        with (watch := CopyStopwatch(remote.device)):
            copy_blocks(self.pool.tensor, src, remote, dst)
        if remote.is_cuda:
            torch.cuda.current_stream(remote.device).synchronize()  # bytes land before the header
        self._copied(t, watch, len(src))
        return BlockWrite(t.rid, t.generation, self.incarnation, dst, False, 0), [], None

    def _copied(self, t: _Transfer, watch: CopyStopwatch, blocks: int) -> None:
        t.times.copy_s += watch.seconds()
        t.times.copied_bytes += blocks * block_bytes(self.pool.tensor)

    def fail_all(self, reason: str) -> None:
        """The receiver is gone: every transfer to it fails and unpins now."""
        for t in list(self._transfers.values()):
            self._finish(t, False, reason)

    def _on_message(self, frames: list) -> None:
        try:
            if len(frames) != 1:
                raise WireError(f"{len(frames)} frames")
            msg = decode(frames[0])
        except WireError:
            return  # a broken reply: the deadline decides
        if isinstance(msg, HandshakeReply):
            if self.handshake_pending:
                self._on_handshake_reply(msg)
            return
        if not isinstance(msg, (Credit, WriteRejected, CommitAck, WindowGrant)):
            return
        if isinstance(msg, Credit):  # credits belong to the pair, even when the transfer is over
            self._credits = min(self._credits + msg.blocks, self._window)
        t = self._transfers.get(msg.rid)
        if t is None or t.generation != msg.generation:
            return
        t.deadline = self._clock() + self.deadline_s  # the receiver is alive and progressing
        if isinstance(msg, Credit):
            if t.in_flight:
                src, _ = t.in_flight.popleft()
                self._unpin(list(src))
        elif isinstance(msg, WindowGrant):
            self._on_window(t, msg)
        elif isinstance(msg, WriteRejected):
            self.needs_handshake |= msg.reason == Verdict.UNKNOWN_INCARNATION.value
            self._finish(t, False, f"rejected by receiver: {msg.reason}", released=msg.reason == Verdict.STALE.value)
        elif isinstance(msg, CommitAck):
            self._finish(
                t,
                msg.ok,
                "" if msg.ok else f"commit refused: {msg.reason}",
                released=not msg.ok and msg.reason == Verdict.STALE.value,
            )

    def _on_window(self, t: _Transfer, grant: WindowGrant) -> None:
        """shm, cuda_ipc: map the window the receiver made for this transfer (a peer's reply: checked first)."""
        ids = grant.block_ids
        error = ""
        if not self._windowed or t.window is not None or not t.window_asked:
            error = "a window nobody asked for"
        elif not ids or len(set(ids)) != len(ids) or not all(0 <= b < self.peer_num_blocks for b in ids):
            error = "window block ids outside the receiver's pool"
        elif (grant.cuda_window is None) != (self.transport == "shm"):
            error = f"a window that is not {self.transport}'s"
        else:
            try:
                t.window = self._map_window(t, grant)
            except (ValueError, OSError, RuntimeError) as exc:  # a name that is not there, a size that differs
                error = f"cannot map the window: {str(exc)[:200]}"
        if error:
            self._finish(t, False, error)
            return
        t.slot_of = {b: i for i, b in enumerate(ids)}

    def _map_window(self, t: _Transfer, grant: WindowGrant) -> torch.Tensor:
        layout, ids = self.pool.layout, grant.block_ids
        if grant.cuda_window is None:
            return attach_window(grant.name, layout, len(ids))
        t.mapping = cuda_ipc.import_buffer(grant.cuda_window, self.pool.tensor.device.index)
        return view_window(t.mapping.bytes(), layout, len(ids))  # ValueError: smaller than the blocks

    def _finish(self, t: _Transfer, ok: bool, reason: str, released: bool = False) -> None:
        t.window = None  # shm: unmapped with its last reference
        if t.mapping is not None:  # cuda_ipc: closed now, and the receiver told it may reuse the window
            t.mapping.free()
            t.mapping = None
            self.channel.send([encode(WindowRelease(t.rid, t.generation, self.incarnation))])
        t.status = TransferStatus.SUCCESS if ok else TransferStatus.FAILED
        pinned = [b for src, _ in t.in_flight for b in src] + [b for src, _ in t.queued for b in src]
        if not ok:
            # In-flight credits may never come back from a dead receiver; reclaim them with the pieces.
            self._credits += sum(len(src) for src, _ in t.in_flight)
        t.in_flight.clear()
        t.queued.clear()
        if pinned:
            self._unpin(pinned)
        if not ok and self._metrics is not None:
            self._metrics.failed_transfers.labels("sender", reason.split(":")[0]).inc()
        if ok and self._metrics is not None:
            self._metrics.observe_sent(self.transport, t.times, time.perf_counter())
        self._events.append(TransferEvent(t.rid, t.generation, ok, reason, released_by_receiver=released))
        if self._transfers.get(t.rid) is t:
            del self._transfers[t.rid]
        self._finished[t.rid] = t.status  # bounded memory of outcomes, for ``status``
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)
