"""The ways KV blocks travel between a prefill and a decode node, one file each, every one a ``Transport``
(base.py). ``TRANSPORTS`` names them in the order a sender prefers them, fastest first; a new transport is
one new file, one line there and its name in configs/schema.py's choices (a test checks both agree)."""

from __future__ import annotations

from .base import DirectTarget, Exports, Pair, Transport
from .cuda_ipc import CudaIpc
from .loopback import Loopback
from .shm import Shm
from .zmq import Zmq

TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Loopback(),
        CudaIpc(),
        Shm(),
        Zmq(),
    )
}
FALLBACK = "zmq"  # every pair can use it

__all__ = ["DirectTarget", "Exports", "Pair", "Transport", "TRANSPORTS", "FALLBACK"]
