"""The two steps every transfer benchmark repeats: a sender and receiver handshaken, and one timed
transfer of n blocks driven to its commit (shared by kv_transfer.py and kv_dtype.py)."""

from __future__ import annotations

import threading
import time

from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender


def handshake(rx: KVReceiver, tx: KVSender, transport: str) -> None:
    stop = threading.Event()
    serving = threading.Thread(target=lambda: [rx.poll() for _ in iter(stop.is_set, True)])
    serving.start()
    try:
        assert tx.handshake().transport == transport
    finally:
        stop.set()
        serving.join()


def one_transfer(rx: KVReceiver, tx: KVSender, rid: str, n: int) -> float:
    """One thread polls both ends (zmq moves bytes on its own I/O thread): no GIL hand-offs measured."""
    ids = list(range(n))
    rx.reserve(rid, 1, ids)
    start = time.perf_counter()
    tx.send(rid, 1, ids, ids)
    tx.commit(rid, 1)
    events = []
    while not events:
        tx.poll()
        events = rx.poll()
    elapsed = time.perf_counter() - start
    while not tx.poll():
        rx.poll()
    assert events[0].ok, events
    rx.adopt(rid)
    return elapsed
