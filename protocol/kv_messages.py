"""Records of the KV transfer plane (prefill node = sender, decode node = receiver).

One conversation per peer pair::

    sender                                  receiver
    Handshake(compat, incarnation, offers) ─▶
                                         ◀─ HandshakeReply(accepted, incarnation, transport, credits)
    WindowRequest(rid, gen, inc)        ─▶   (shm, cuda_ipc: once per transfer, before its first write)
                                         ◀─ WindowGrant(rid, gen, segment | IPC handle, block ids)  (assigned key only)
    BlockWrite(rid, gen, inc, dst ids) [+ raw block bytes when inline]  ─▶   (per prefill chunk)
                                         ◀─ Credit(blocks)  (+ WriteRejected when fenced off)
    Commit(rid, gen, inc, first token)  ─▶
                                         ◀─ CommitAck(rid, gen, ok, reason)
    Abort(rid, gen, inc)                ─▶   (idempotent)
    WindowRelease(rid, gen, inc)        ─▶   (cuda_ipc: the sender unmapped the window; it may be reused)

Every frame that touches blocks carries ``(rid, generation, sender incarnation)`` so the receiver can
refuse a late write for a reused range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import wire_record

# 2: cuda_ipc per-transfer windows, never the pool; 3: int8 KV rows with a float16 scale per 16 values
# (kernels/triton/kv_int8.py), the same bytes as the float32 scale per 32 of version 2: only the
# version tells the two apart, so a peer of the old format is refused, never misread
KV_PROTOCOL_VERSION = 3


@wire_record("kv.compat")
@dataclass(frozen=True, slots=True)
class KVCompat:
    """What two nodes must agree on before one writes into the other's pool."""

    protocol_version: int
    model: str  # model id or path basename; same weights on both sides
    dtype: str  # "float32", "bfloat16", ...
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int


@wire_record("kv.handshake")
@dataclass(slots=True)
class Handshake:
    compat: KVCompat
    sender_incarnation: str  # new on every process start; invalidates cached handshakes
    hostname: str  # shm / cuda_ipc only make sense on one host
    transports: list[str]  # offered, preference order (kvtransfer/transports/)
    cuda_device: int | None = None  # sender's device when it can use cuda_ipc


@wire_record("kv.cuda_ipc_handle")
@dataclass(slots=True)
class CudaIpcHandle:
    """cuda_ipc: one transfer window's allocation, of its own (kvtransfer/cuda_ipc.py), granted per transfer."""

    device: int  # the exporter's device index (informational: the importer maps it into its own device)
    handle: bytes  # the CUipcMemHandle, 64 bytes
    size_bytes: int  # the whole allocation: all a peer that maps it can see


@wire_record("kv.handshake_reply")
@dataclass(slots=True)
class HandshakeReply:
    accepted: bool
    receiver_incarnation: str
    transport: str  # chosen for this pair; "" when refused
    credits: int  # blocks the sender may have in flight
    num_blocks: int  # receiver pool size; dst block ids are below it
    error: str = ""  # why it was refused, naming the field
    mismatched_field: str = ""
    shm_pool_name: str | None = None  # unused since per-transfer windows (WindowGrant); kept for old peers
    shm_fence_name: str | None = None  # shm / cuda_ipc: per-block owner tokens
    cuda_pool: CudaIpcHandle | None = None  # unused since per-transfer windows (WindowGrant.cuda_window)


@wire_record("kv.block_write")
@dataclass(slots=True)
class BlockWrite:
    """Header of one write. ``inline``: block bytes follow as one raw frame ``[L, 2, n, bs, kvh, d]``;
    otherwise the sender already copied them into the receiver's pool (shm / cuda_ipc / loopback)."""

    rid: str
    generation: int
    sender_incarnation: str
    dst_block_ids: list[int]
    inline: bool
    num_bytes: int  # of the raw frame; 0 when not inline

    def __post_init__(self):
        assert self.dst_block_ids, "a write names at least one block"
        assert len(set(self.dst_block_ids)) == len(self.dst_block_ids), "duplicate destination block"
        assert self.num_bytes >= 0 and (self.inline or self.num_bytes == 0)


@wire_record("kv.commit")
@dataclass(slots=True)
class Commit:
    """Last message of a transfer; may carry the first sampled token (TTFT is measured at P)."""

    rid: str
    generation: int
    sender_incarnation: str
    first_token: int | None = None
    first_logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # The LoRA adapter the KV was computed under ("" = the base): the receiver's request must run under
    # the same one, or the KV (and the first token) belong to another model
    lora_name: str = ""
    # ... and its files' sha256 as the sender read them (engine/lora/adapter.py files_digest): the same
    # name loaded from a directory rewritten between the two workers' loads is another adapter
    lora_digest: str = ""

    def __post_init__(self):
        assert len(self.top_token_ids) == len(self.top_logprobs), "top logprobs need one id per value"
        assert len(self.lora_digest) <= 64, "a LoRA digest is a sha256 hex string"


@wire_record("kv.abort")
@dataclass(slots=True)
class Abort:
    rid: str
    generation: int
    sender_incarnation: str
    reason: str = ""


@wire_record("kv.credit")
@dataclass(slots=True)
class Credit:
    """Receiver -> sender: ``blocks`` more may be in flight; acknowledges the writes of ``rid``."""

    rid: str
    generation: int
    blocks: int

    def __post_init__(self):
        assert self.blocks >= 0


@wire_record("kv.write_rejected")
@dataclass(slots=True)
class WriteRejected:
    """Receiver -> sender: the transfer is dead on this side (stale, unknown, expired, aborted)."""

    rid: str
    generation: int
    reason: str


@wire_record("kv.commit_ack")
@dataclass(slots=True)
class CommitAck:
    rid: str
    generation: int
    ok: bool
    reason: str = ""


@wire_record("kv.window_request")
@dataclass(slots=True)
class WindowRequest:
    """shm, cuda_ipc: the sender asks for the window of one transfer (kvtransfer/shm_window.py, cuda_window.py)."""

    rid: str
    generation: int
    sender_incarnation: str


@wire_record("kv.window_grant")
@dataclass(slots=True)
class WindowGrant:
    """A window ``[L, 2, len(block_ids), bs, kvh, d]`` holding only this transfer's blocks, slot i for
    ``block_ids[i]``, sent only to the key the range was reserved for: shm names a /dev/shm segment
    (unlinked at the first write), cuda_ipc an allocation of its own (``cuda_window``; ``name`` is "")."""

    rid: str
    generation: int
    name: str
    block_ids: list[int]
    cuda_window: CudaIpcHandle | None = None


@wire_record("kv.window_release")
@dataclass(slots=True)
class WindowRelease:
    """cuda_ipc: the sender closed its mapping of the transfer's window: the receiver may scrub and reuse it
    (kvtransfer/window_arena.py). Only the key it was granted to can release it."""

    rid: str
    generation: int
    sender_incarnation: str
