"""Block hashes of a token sequence: the one function the gateway and every node agree on.

A full block's hash chains its parent's, so equal hashes mean equal whole prefixes, not just equal
blocks. blake2b (not Python's ``hash``) keeps hashes identical across processes and hosts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block, chained to the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``; a partial tail block has none."""
    assert block_size > 0, block_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
