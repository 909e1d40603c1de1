"""Block hashes of a token sequence: the one function the gateway and every node agree on.

A full block's hash chains its parent's, so equal hashes mean equal whole prefixes, not just equal
blocks. SHA-256 over the parent's 32 bytes and the block's tokens (as vLLM's ``sha256`` prefix-caching
hash): identical across processes and hosts, and with 256 bits no tenant can craft a prompt whose block
collides with another tenant's cached one (a 64-bit hash made that a feasible search). Hashes never
cross a socket: the gateway and every worker compute them from the tokens, so all of them change together.

A request's ``cache_salt`` (vLLM's field) replaces the first block's parent: every hash of a salted
sequence differs from the unsalted one's and from any other salt's, so tenants that salt differently
never share prefix KV (nor can they time each other's cache hits). A request's LoRA adapter enters the
same root: KV computed under one adapter (or the base) is never reused under another.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # parent hash of a sequence's first block


HASH_BYTES = 32


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """256-bit hash of one full block, chained to the hash of the block before it."""
    h = hashlib.sha256(parent_hash.to_bytes(HASH_BYTES, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def root_hash(cache_salt: str = "", lora: str = "") -> int:
    """Parent hash of a sequence's first block: ROOT_HASH for the base model unsalted, else one derived
    from the salt and the adapter (``lora_identity``)."""
    if not cache_salt and not lora:
        return ROOT_HASH
    seed = b"pdserve-cache-salt\0" + cache_salt.encode("utf-8")
    if lora:
        seed = b"pdserve-lora\0" + lora.encode("utf-8") + b"\0" + seed
    return int.from_bytes(hashlib.sha256(seed).digest(), "little")


def lora_identity(lora_name: str, lora_path: str, digest: str = "") -> str:
    """What a block hash knows of a request's adapter: its name and the directory it was loaded from,
    so an adapter unloaded and loaded again from elsewhere under the same name shares no KV with the old;
    on a worker also its files' digest (engine/lora/adapter.py), so neither does one loaded again from
    the same directory rewritten in place. (The gateway, which never reads the files, hashes without
    it: its hashes only predict where a prompt is cached.)"""
    if not lora_name:
        return ""
    return f"{lora_name}\0{lora_path}\0{digest}" if digest else f"{lora_name}\0{lora_path}"


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "", lora: str = "") -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``; a partial tail block has none."""
    assert block_size > 0, block_size
    hashes: list[int] = []
    parent = root_hash(cache_salt, lora)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
