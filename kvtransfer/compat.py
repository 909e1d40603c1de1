"""Compatibility of two pools: a peer whose KV layout differs must never write into ours."""

from __future__ import annotations

import dataclasses
import uuid

from kvtransfer.pool import PoolLayout
from protocol.kv_messages import KV_PROTOCOL_VERSION, KVCompat


def compat_of(model: str, layout: PoolLayout) -> KVCompat:
    return KVCompat(
        protocol_version=KV_PROTOCOL_VERSION,
        model=model,
        dtype=str(layout.dtype).removeprefix("torch."),
        num_layers=layout.num_layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
    )


def first_mismatch(ours: KVCompat, theirs: KVCompat) -> str | None:
    """Name of the first field that differs (protocol version first), or None."""
    for f in dataclasses.fields(ours):
        if getattr(ours, f.name) != getattr(theirs, f.name):
            return f.name
    return None


def describe_mismatch(ours: KVCompat, theirs: KVCompat, name: str) -> str:
    return f"incompatible KV peer: {name} is {getattr(theirs, name)!r} there but {getattr(ours, name)!r} here"


def new_incarnation() -> str:
    """Fresh id per process start: a restarted peer is a different peer."""
    return uuid.uuid4().hex
