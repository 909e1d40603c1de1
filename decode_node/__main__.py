"""``python -m decode_node --config FILE [--set section.field=value ...]``: run one decode worker.

Prints one line ``READY http_port=<p> kv_address=<endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import os
import sys

from decode_node.node import DecodeNode
from protocol.curve import ClusterKeyError
from worker import install_drain, setup_logging
from worker.cli import load_worker_config


def main(argv: list[str] | None = None) -> int:
    loaded = load_worker_config("python -m decode_node", "pdserve decode worker", argv)
    if loaded is None:
        return 2
    config, log_level = loaded
    setup_logging("decode", config.decode.worker_id or "-", log_level)
    try:
        node = DecodeNode.start(config)
    except ClusterKeyError as exc:
        print(f"decode worker: {exc}", file=sys.stderr)
        return 2
    install_drain(node.server.request_drain)
    print(f"READY http_port={node.http.port} kv_address={node.server.options.kv_address} "
          f"worker_id={node.server.options.worker_id} pid={os.getpid()}", flush=True)
    try:
        node.server.run()
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
