"""``python -m prefill_node --config FILE [--set section.field=value ...]``: run one prefill worker.

Prints one line ``READY http_port=<p> address=<job endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import logging
import os
import sys

import zmq

from configs.schema import EX_CONFIG, ConfigError
from prefill_node.build import build_prefill_server
from protocol.curve import ClusterKeyError
from worker import default_worker_id, install_drain, serve_http, setup_logging
from worker.cli import load_worker_config
from worker.ready_line import announce_ready

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    loaded = load_worker_config("python -m prefill_node", "pdserve prefill worker", argv)
    if loaded is None:
        return EX_CONFIG
    config, log_level = loaded
    if not config.prefill.worker_id:  # named once: the log lines of the start-up carry it too
        config.prefill.worker_id = default_worker_id("prefill")
    setup_logging("prefill", config.prefill.worker_id, log_level, config.observability.log_format)
    ctx = zmq.Context()
    try:
        server = build_prefill_server(config, ctx)
    except (ConfigError, ClusterKeyError) as exc:  # the model or the key: one line, and no restart helps
        print(f"pdserve prefill: {exc}", file=sys.stderr)
        return EX_CONFIG
    http = serve_http(config.prefill.host, config.prefill.http_port, server.metrics.registry, server.is_ready)
    install_drain(server.request_drain)
    log.info(
        "prefill worker %s: jobs at %s, http %s:%d, gateway %s",
        server.options.worker_id,
        server.address,
        config.prefill.host,
        http.port,
        config.prefill.gateway_address,
    )
    announce_ready(http_port=http.port, address=server.address, worker_id=server.options.worker_id, pid=os.getpid())
    try:
        server.serve_forever()
    finally:
        http.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
