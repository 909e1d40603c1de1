"""``python -m decode_node --config FILE [--set section.field=value ...]``: run one decode worker.

Prints one line ``READY http_port=<p> kv_address=<endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import os
import sys

from configs.schema import EX_CONFIG, ConfigError
from decode_node.node import DecodeNode
from protocol.curve import ClusterKeyError
from worker import default_worker_id, install_drain, setup_logging
from worker.cli import load_worker_config
from worker.ready_line import announce_ready


def main(argv: list[str] | None = None) -> int:
    loaded = load_worker_config("python -m decode_node", "pdserve decode worker", argv)
    if loaded is None:
        return EX_CONFIG
    config, log_level = loaded
    if not config.decode.worker_id:  # named once: the log lines of the start-up carry it too
        config.decode.worker_id = default_worker_id("decode")
    setup_logging("decode", config.decode.worker_id, log_level, config.observability.log_format)
    try:
        node = DecodeNode.start(config)
    except (ConfigError, ClusterKeyError) as exc:  # the model or the key: one line, and no restart helps
        print(f"pdserve decode: {exc}", file=sys.stderr)
        return EX_CONFIG
    install_drain(node.server.request_drain)
    announce_ready(
        http_port=node.http.port,
        kv_address=node.server.options.kv_address,
        worker_id=node.server.options.worker_id,
        pid=os.getpid(),
    )
    try:
        node.server.run()
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
