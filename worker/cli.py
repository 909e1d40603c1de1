"""The command line both worker kinds share: ``--config FILE [--set section.field=value ...] [--log-level]``."""

from __future__ import annotations

import argparse
import logging
import sys

from configs.loader import load_config
from configs.schema import ConfigError, PdserveConfig
from telemetry.tracing import check_tracing


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.field=value, got {item!r}")
        overrides[key] = value
    return overrides


def load_worker_config(prog: str, description: str, argv: list[str] | None) -> tuple[PdserveConfig, str] | None:
    """(config, log level) from the command line, or None after printing a config error."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config file (configs/schema.py lists every field)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--log-level", help="debug, info, warning, error or critical (observability.log_level)")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.set)
    if args.log_level:
        overrides["observability.log_level"] = args.log_level.lower()
    # Until the worker sets up its own format (worker/logs.py, once its id is known): what loading the
    # config logs (environment variables it ignores, configs/environment.py) is shown at the asked level.
    logging.basicConfig(
        level=(args.log_level or "info").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config, overrides=overrides)
        check_tracing(config.observability.otlp_traces_endpoint)  # before the model loads, not after
        return config, config.observability.log_level
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None
