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

from configs.loader import load_config
from configs.schema import EX_CONFIG, ConfigError, PdserveConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description="pdserve OpenAI-compatible gateway")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--host", help="HTTP and worker interface (gateway.host)")
    p.add_argument("--port", type=int, help="HTTP port (gateway.port)")
    p.add_argument("--worker-port", type=int, help="ZeroMQ port for workers (gateway.worker_port)")
    p.add_argument("--model", help="model directory (model.path); its tokenizer is loaded")
    p.add_argument("--api-key", action="append", help="accepted bearer key; repeat for several")
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="origins whose browser pages may call the API (CORS; '*': any) (gateway.allowed_origins)",
    )
    add_chat_parser_args(p)
    p.add_argument("--log-level", help="debug, info, warning, error or critical (observability.log_level)")
    return p.parse_args(argv)


def add_chat_parser_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the chat output readers; ``pdserve serve`` takes them too."""
    from gateway.text.reasoning import REASONING_PARSERS
    from gateway.text.tool_parsers import TOOL_CALL_PARSERS

    p.add_argument(
        "--reasoning-parser",
        choices=("none",) + REASONING_PARSERS,
        help="split <think> reasoning into the message's reasoning field (gateway.reasoning_parser)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("none",) + TOOL_CALL_PARSERS,
        help="read the model's own tool calls, for tool_choice 'auto' (gateway.tool_call_parser)",
    )


def overrides_of(args: argparse.Namespace) -> dict:
    given = {
        "gateway.host": args.host,
        "gateway.port": args.port,
        "gateway.worker_port": args.worker_port,
        "model.path": args.model,
        "gateway.api_keys": args.api_key,
        "gateway.allowed_origins": args.allowed_origins,
        "gateway.reasoning_parser": args.reasoning_parser,
        "gateway.tool_call_parser": args.tool_call_parser,
        "observability.log_level": args.log_level,
    }
    return {k: v for k, v in given.items() if v is not None}


def model_dir(config: PdserveConfig) -> Path:
    """The checkpoint's directory; a hub id fetches its config and tokenizer only (no weights)."""
    from configs.model_source import resolve_model  # makes the default model (with torch) only if not cached

    return resolve_model(config.model.path, config.model.cache_dir, weights=False)


def context_length(path: Path, configured: int | None) -> int:
    if configured is not None:
        return configured
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return int(hf_config["max_position_embeddings"])


def build(config: PdserveConfig):
    """(app, backend) for ``config``; torch-free."""
    from gateway.http.app import GatewayParams, build_app
    from gateway.metrics import GatewayMetrics
    from gateway.serving.lora_adapters import LoRAAdapters
    from gateway.serving.pipeline import ServingLimits
    from gateway.text.chat_output import ChatParsers
    from gateway.text.tokenizer import Tokenizer
    from gateway.workers.registry import WorkerRegistry
    from gateway.workers.router import Policy, RouterParams
    from gateway.workers.zmq_backend import ZmqBackend, ZmqBackendParams
    from protocol.curve import plane_security
    from telemetry.tracing import tracer_for

    g = config.gateway
    path = model_dir(config)
    logging.getLogger("pdserve.gateway").info(
        "model %s: tokenizer and config from %s", config.model.path or "(the embedded default)", path
    )
    registry = WorkerRegistry(
        heartbeat_interval_s=g.worker_heartbeat_s,
        max_missed=max(1, round(g.worker_timeout_s / g.worker_heartbeat_s)),
        step_timeout_s=g.worker_step_timeout_s,
    )
    name = config.model.name_for_clients()
    max_model_len = context_length(path, config.model.max_model_len)
    metrics = GatewayMetrics(name, max_model_len)
    router = RouterParams(config.engine.block_size, Policy(g.routing_policy), g.local_prefill_max_tokens)
    backend = ZmqBackend(
        registry,
        metrics,
        ZmqBackendParams(
            g.host,
            g.worker_port,
            router,
            max_queued_requests=g.max_queued_requests,
            queue_timeout_s=g.queue_timeout_s,
            default_timeout_s=g.request_timeout_s,
            security=plane_security(config.transfer.cluster_key_file, config.transfer.insecure, "gateway"),
            lora_modules=config.lora.modules(),
        ),
    )
    limits = ServingLimits(
        name,
        max_model_len,
        request_timeout_s=g.request_timeout_s or None,
        max_prompt_logprobs_entries=g.max_prompt_logprobs_entries,
        sse_keepalive_s=g.sse_keepalive_s or None,
        cache_salt_per_api_key=g.cache_salt_per_api_key,
    )
    parsers = ChatParsers(
        None if g.reasoning_parser == "none" else g.reasoning_parser,
        None if g.tool_call_parser == "none" else g.tool_call_parser,
    )
    adapters = LoRAAdapters(name, config.lora.enable_lora, config.lora.modules(), backend.lora_adapters)
    params = GatewayParams(
        Tokenizer(path, config.model.chat_template),
        backend,
        limits,
        api_keys=list(g.api_keys),
        admin_api_keys=list(g.admin_api_keys),
        lora_adapters=adapters,
        max_body_bytes=g.max_body_bytes,
        registry=registry,
        metrics=metrics,
        chat_parsers=parsers,
        allowed_origins=list(g.allowed_origins),
        response_store=response_store(g),
        tracer=tracer_for("gateway", "gateway", config.observability.otlp_traces_endpoint),
    )
    return build_app(params), backend


def response_store(g):
    """The Responses API's store: in this process's memory, or the Redis the replicas share."""
    if g.responses_store_url:
        from gateway.dialects.responses.redis_store import RedisResponseStore

        return RedisResponseStore(g.responses_store_url, g.responses_store_mb << 20)
    from gateway.dialects.responses.store import ResponseStore

    return ResponseStore(g.responses_store_mb << 20)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, overrides=overrides_of(args))
    except (ConfigError, OSError) as e:
        print(f"pdserve gateway: {e}", file=sys.stderr)
        return EX_CONFIG
    import uvicorn

    from protocol.curve import ClusterKeyError
    from telemetry.logs import setup_logging

    from .http.limits import HttpLimits, uvicorn_options

    setup_logging("gateway", "gateway", config.observability.log_level, config.observability.log_format)
    try:
        app, _ = build(config)
    except (ConfigError, ClusterKeyError) as e:  # the model or the key: one line, and no restart helps
        print(f"pdserve gateway: {e}", file=sys.stderr)
        return EX_CONFIG
    g = config.gateway
    limits = HttpLimits(
        g.http_header_timeout_s, g.http_body_timeout_s, g.http_write_timeout_s, g.max_connections or None
    )
    # uvicorn handles SIGINT/SIGTERM: stops accepting, finishes open responses, runs the lifespan exit,
    # then re-raises the signal under the handler found before it; a drained stop is a clean exit, so 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # log_config=None: uvicorn's records go through the root handler, in the format asked for
    uvicorn.run(
        app,
        host=config.gateway.host,
        port=config.gateway.port,
        log_level=config.observability.log_level,
        log_config=None,
        timeout_graceful_shutdown=30,
        **uvicorn_options(limits),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
