"""``python -m gateway --config FILE [--host H] [--port P] [--model PATH] [--api-key KEY ...]
[--reasoning-parser NAME] [--tool-call-parser NAME]``.

Loads configs.schema (CLI > env PDSERVE_* > YAML > defaults), the tokenizer from the model directory,
binds the worker ROUTER at gateway.host:gateway.worker_port, and serves the app with uvicorn. SIGINT or
SIGTERM stops it gracefully: uvicorn finishes open responses, then the backend aborts what is left.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from configs.schema import ConfigError, PdserveConfig, load_config


DEFAULT_MODEL_NAME = "pdserve-small"  # what clients call the embedded default model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description="pdserve OpenAI-compatible gateway")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--host", help="HTTP and worker interface (gateway.host)")
    p.add_argument("--port", type=int, help="HTTP port (gateway.port)")
    p.add_argument("--worker-port", type=int, help="ZeroMQ port for workers (gateway.worker_port)")
    p.add_argument("--model", help="model directory (model.path); its tokenizer is loaded")
    p.add_argument("--api-key", action="append", help="accepted bearer key; repeat for several")
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="origins whose browser pages may call the API (CORS; '*': any) (gateway.allowed_origins)")
    add_chat_parser_args(p)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def add_chat_parser_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the chat output readers; ``pdserve serve`` takes them too."""
    from .reasoning import REASONING_PARSERS
    from .tool_parsers import TOOL_CALL_PARSERS

    p.add_argument("--reasoning-parser", choices=("none",) + REASONING_PARSERS,
                   help="split <think> reasoning into the message's reasoning field (gateway.reasoning_parser)")
    p.add_argument("--tool-call-parser", choices=("none",) + TOOL_CALL_PARSERS,
                   help="read the model's own tool calls, for tool_choice 'auto' (gateway.tool_call_parser)")


def overrides_of(args: argparse.Namespace) -> dict:
    given = {"gateway.host": args.host, "gateway.port": args.port, "gateway.worker_port": args.worker_port,
             "model.path": args.model, "gateway.api_keys": args.api_key, "gateway.allowed_origins": args.allowed_origins,
             "gateway.reasoning_parser": args.reasoning_parser, "gateway.tool_call_parser": args.tool_call_parser}
    return {k: v for k, v in given.items() if v is not None}


def model_dir(config: PdserveConfig) -> Path:
    from cluster.default_model import configured_model_path  # makes it (with torch) only if not cached yet

    return Path(configured_model_path(config.model.path, config.model.cache_dir))


def context_length(path: Path, configured: int | None) -> int:
    if configured is not None:
        return configured
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return int(hf_config["max_position_embeddings"])


def build(config: PdserveConfig):
    """(app, backend) for ``config``; torch-free."""
    from .app import GatewayParams, build_app
    from .chat_output import ChatParsers
    from .metrics import GatewayMetrics
    from .registry import WorkerRegistry
    from .response_store import ResponseStore
    from .router import Policy, RouterParams
    from .serving import ServingLimits
    from .tokenizer import Tokenizer
    from .zmq_backend import ZmqBackend, ZmqBackendParams
    from protocol.curve import plane_security

    g = config.gateway
    path = model_dir(config)
    registry = WorkerRegistry(heartbeat_interval_s=g.worker_heartbeat_s,
                              max_missed=max(1, round(g.worker_timeout_s / g.worker_heartbeat_s)))
    metrics = GatewayMetrics()
    router = RouterParams(config.engine.block_size, Policy(g.routing_policy), g.local_prefill_max_tokens)
    backend = ZmqBackend(registry, metrics, ZmqBackendParams(
        g.host, g.worker_port, router, max_queued_requests=g.max_queued_requests, queue_timeout_s=g.queue_timeout_s,
        default_timeout_s=g.request_timeout_s,
        security=plane_security(config.transfer.cluster_key_file, config.transfer.insecure)))
    name = config.model.served_model_name or config.model.path or DEFAULT_MODEL_NAME
    limits = ServingLimits(name, context_length(path, config.model.max_model_len),
                           request_timeout_s=g.request_timeout_s or None)
    parsers = ChatParsers(None if g.reasoning_parser == "none" else g.reasoning_parser,
                          None if g.tool_call_parser == "none" else g.tool_call_parser)
    params = GatewayParams(Tokenizer(path), backend, limits, api_keys=list(g.api_keys),
                           max_body_bytes=g.max_body_bytes, registry=registry, metrics=metrics, chat_parsers=parsers,
                           allowed_origins=list(g.allowed_origins), response_store=ResponseStore(g.responses_store_mb << 20))
    return build_app(params), backend


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = load_config(args.config, overrides=overrides_of(args))
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from protocol.curve import ClusterKeyError

    try:
        app, _ = build(config)
    except ClusterKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # uvicorn handles SIGINT/SIGTERM: stops accepting, finishes open responses, runs the lifespan exit,
    # then re-raises the signal under the handler found before it; a drained stop is a clean exit, so 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=config.gateway.host, port=config.gateway.port, log_level=args.log_level,
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
