"""``pdserve serve`` says ready only when every worker it started has registered: the gateway's /ready
is satisfied by one decode worker alone (cluster/serve.py)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cluster.serve import registered_workers, wait_ready
from gateway.metrics import GatewayMetrics


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

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "ready"}' if self.path == "/ready" else metrics.render()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, cluster = f"http://127.0.0.1:{server.server_address[1]}", _Cluster()
    try:
        assert not wait_ready(url, cluster, 1.0, {"prefill": 1, "decode": 1})
        assert cluster.ticks >= 2  # the workers stay supervised while it waits
        metrics.pool_workers.labels("prefill").set(1)
        assert wait_ready(url, cluster, 5.0, {"prefill": 1, "decode": 1})
        assert wait_ready(url, cluster, 5.0, {"prefill": 0, "decode": 1})  # --prefill 0: decode alone
    finally:
        server.shutdown()
        server.server_close()
