"""``python -m prefill_node --config FILE [--set section.field=value ...]``: run one prefill worker.

Prints one line ``READY http_port=<p> address=<job endpoint> worker_id=<id> pid=<pid>`` on stdout once serving
(tests and supervisors asking for port 0 read the ports from it). SIGTERM drains, then exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import zmq

from configs.schema import ConfigError, load_config
from prefill_node.build import build_prefill_server
from worker import install_drain, serve_http, setup_logging


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.field=value, got {item!r}")
        overrides[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefill_node", description="pdserve prefill worker")
    parser.add_argument("--config", help="YAML config file (configs/schema.py lists every field)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides=parse_overrides(args.set))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    server = build_prefill_server(config, ctx)
    setup_logging("prefill", server.options.worker_id, args.log_level)
    http = serve_http(config.prefill.host, config.prefill.http_port, server.metrics.registry, server.is_ready)
    install_drain(server.request_drain)
    print(f"READY http_port={http.port} address={server.address} worker_id={server.options.worker_id} pid={os.getpid()}", flush=True)
    try:
        server.serve_forever()
    finally:
        http.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
