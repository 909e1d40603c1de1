"""What a poll reports: one transfer attempt finished, well or not."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.kv_messages import Commit


class TransferStatus(enum.IntEnum):
    """Per-transfer status on the sender, ordered so ``status >= SUCCESS`` means finished."""

    PENDING = 0  # queued, nothing shipped yet
    TRANSFERRING = 1
    SUCCESS = 2
    FAILED = 3


@dataclass(slots=True)
class TransferEvent:
    rid: str
    generation: int
    ok: bool
    reason: str = ""  # why it failed: "lease expired", "stale", "receiver silent past deadline", ...
    commit: Commit | None = None  # receiver side, on success: carries the first token and its logprobs
    block_ids: tuple[int, ...] = ()  # receiver side: the range (committed, or already released on failure)
    # Sender side: the receiver no longer holds the range (it aborted it, its lease ran out, or a newer
    # attempt replaced it), so it has already dropped the request: an abort, with nobody to tell.
    released_by_receiver: bool = False
