"""The sender's transfer figures: the copy itself, the exposed tail after the last chunk, the span."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtransfer.copy_timing import CopyStopwatch, block_bytes
from kvtransfer.metrics import TransferMetrics
from tests.test_kvtransfer_transports import LAYOUT, Node, pump

GAP_S = 0.05  # between the first chunk and the commit: the prefill of the later chunks


@pytest.mark.parametrize("transport", ["shm", "zmq", "loopback"])
def test_copy_exposed_and_span_add_up(transport):
    node = Node(transport)
    registry = CollectorRegistry()
    try:
        tx = node.sender(metrics=TransferMetrics(registry))
        src_ids, dst_ids = [0, 5, 2, 9, 11], [14, 3, 8, 1, 6]
        node.reserve("r1", 1, dst_ids)
        tx.send("r1", 1, src_ids[:2], dst_ids[:2])
        pump(node, tx, until=lambda rx, _: tx.pinned_blocks() == [], steps=2000)
        time.sleep(GAP_S)
        tx.send("r1", 1, src_ids[2:], dst_ids[2:])
        tx.commit("r1", 1, first_token=42)
        _, tx_events = pump(node, tx, until=lambda rx, tx_ev: rx and tx_ev)
        assert [(e.rid, e.ok) for e in tx_events] == [("r1", True)]

        def sample(name: str) -> float:
            value = registry.get_sample_value(name, {"transport": transport})
            assert value is not None, name
            return value

        assert sample("pdserve:kv_transfer_copy_bytes_total") == 5 * LAYOUT.bytes_per_block
        for name in ("copy", "exposed", "span"):
            assert sample(f"pdserve:kv_transfer_{name}_seconds_count") == 1
        copy, exposed, span = (sample(f"pdserve:kv_transfer_{n}_seconds_sum") for n in ("copy", "exposed", "span"))
        assert 0 < copy < span
        # The first chunk went before the gap, the commit after it: the span holds the gap, the tail does not.
        assert span - exposed >= GAP_S
        assert exposed > 0
        assert torch.equal(node.rx.pool.tensor[:, :, dst_ids], tx.pool.tensor[:, :, src_ids])
    finally:
        node.close()


def test_failed_transfer_reports_no_timing():
    node = Node("shm")
    registry = CollectorRegistry()
    try:
        tx = node.sender(metrics=TransferMetrics(registry))
        node.reserve("r1", 1, [3])
        tx.send("r1", 1, [0], [3])
        tx.abort("r1", 1, "client went away")
        assert registry.get_sample_value("pdserve:kv_transfer_span_seconds_count", {"transport": "shm"}) is None
    finally:
        node.close()


def test_stopwatch_on_cpu_times_the_copy_and_block_bytes():
    pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.dtype)
    assert block_bytes(pool) == LAYOUT.bytes_per_block
    big = torch.randn(4 << 20)
    with (watch := CopyStopwatch(big.device)):
        out = big.clone()
    assert watch.seconds() > 0 and torch.equal(out, big)
