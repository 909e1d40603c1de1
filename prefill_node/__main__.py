"""``python -m prefill_node --config FILE [--set section.field=value ...]``: run one prefill worker.

Prints one line ``READY http_port=<p> address=<job endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import os
import sys

import zmq

from prefill_node.build import build_prefill_server
from protocol.curve import ClusterKeyError
from worker import install_drain, serve_http, setup_logging
from worker.cli import load_worker_config


def main(argv: list[str] | None = None) -> int:
    loaded = load_worker_config("python -m prefill_node", "pdserve prefill worker", argv)
    if loaded is None:
        return 2
    config, log_level = loaded
    ctx = zmq.Context()
    try:
        server = build_prefill_server(config, ctx)
    except ClusterKeyError as exc:
        print(f"prefill worker: {exc}", file=sys.stderr)
        return 2
    setup_logging("prefill", server.options.worker_id, log_level)
    http = serve_http(config.prefill.host, config.prefill.http_port, server.metrics.registry, server.is_ready)
    install_drain(server.request_drain)
    print(f"READY http_port={http.port} address={server.address} worker_id={server.options.worker_id} "
          f"pid={os.getpid()}", flush=True)
    try:
        server.serve_forever()
    finally:
        http.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
