"""``python -m decode_node --config FILE [--set section.field=value ...]``: run one decode worker.

Prints one line ``READY http_port=<p> kv_address=<endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

from configs.schema import ConfigError, load_config
from decode_node.node import DecodeNode
from worker import install_drain, setup_logging


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.field=value, got {item!r}")
        overrides[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decode_node", description="pdserve decode worker")
    parser.add_argument("--config", help="YAML config file (configs/schema.py lists every field)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides=parse_overrides(args.set))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    setup_logging("decode", config.decode.worker_id or "-", args.log_level)
    node = DecodeNode.start(config)
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
