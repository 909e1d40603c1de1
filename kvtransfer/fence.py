"""Per-block owner tokens for transports that write straight into the receiver's pool.

With loopback the sender's bytes land before the receiver sees the header, so the
receiver's ownership check alone cannot stop a late write into reused pages. The receiver therefore
publishes, for every reserved block, the token of its live ``(rid, generation)`` (0 when free); the
sender copies a block only if every destination still shows its token. The remaining window — a
reuse between the sender's check and its copy — is bounded by one block copy; lease expiry (seconds)
is what reuses blocks, so in practice a paused sender fails the check.
"""

from __future__ import annotations

import hashlib

import torch

FREE = 0


def fence_token(rid: str, generation: int) -> int:
    """Nonzero 63-bit token of one transfer attempt (fits int64)."""
    digest = hashlib.blake2b(f"{generation}:{rid}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def holds(fence: torch.Tensor, block_ids: torch.Tensor, token: int) -> bool:
    """fence: [num_blocks] int64; True when every block of ``block_ids`` shows ``token``."""
    return bool((fence.index_select(0, block_ids) == token).all())
