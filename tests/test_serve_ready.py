"""``pdserve serve`` says ready only when every worker it started has registered: the gateway's /ready
is satisfied by one decode worker alone (cluster/serve.py)."""

from __future__ import annotations

import time

from cluster.serve import registered_workers, wait_ready
from gateway.metrics import GatewayMetrics
from tests.fake_http import http_get_server


def test_registered_workers_reads_the_gateway_gauge():
    metrics = GatewayMetrics()
    metrics.pool_workers.labels("prefill").set(2)
    metrics.pool_workers.labels("decode").set(1)
    assert registered_workers(metrics.render().decode()) == {"prefill": 2, "decode": 1}
    assert registered_workers("") == {}


class _Cluster:  # what wait_ready needs of LocalCluster: a supervision tick
    def __init__(self) -> None:
        self.ticks = 0

    def supervise_once(self) -> None:
        self.ticks += 1


def test_ready_waits_for_the_prefill_workers_too():
    metrics = GatewayMetrics()
    metrics.pool_workers.labels("decode").set(1)  # /ready answers 200 from here on

    def answer(path, headers) -> bytes:
        return b'{"status": "ready"}' if path == "/ready" else metrics.render()

    cluster = _Cluster()
    with http_get_server(answer) as url:
        assert not wait_ready([url], cluster, 1.0, {"prefill": 1, "decode": 1})
        assert cluster.ticks >= 2  # the workers stay supervised while it waits
        metrics.pool_workers.labels("prefill").set(1)
        assert wait_ready([url], cluster, 5.0, {"prefill": 1, "decode": 1})
        assert wait_ready([url], cluster, 5.0, {"prefill": 0, "decode": 1})  # --prefill 0: decode alone


def test_a_stop_while_starting_ends_the_wait_at_once():
    # SIGTERM before the workers are up: `pdserve serve` stops now, not after --ready-timeout.
    def answer(path, headers) -> bytes:
        return GatewayMetrics().render()

    cluster = _Cluster()
    with http_get_server(answer) as url:
        started = time.monotonic()
        assert not wait_ready([url], cluster, 600.0, {"prefill": 1, "decode": 1}, stopped=lambda: cluster.ticks >= 2)
        assert cluster.ticks == 2 and time.monotonic() - started < 60
