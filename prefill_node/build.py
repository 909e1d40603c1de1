"""Builds a prefill server from the typed config: engine, metrics registry, sockets."""

from __future__ import annotations

import dataclasses

import zmq
from prometheus_client import CollectorRegistry

from configs.model_source import resolve_model
from configs.schema import EngineConfig, PdserveConfig
from engine.llm import build_engine
from kvtransfer.transports import TRANSPORTS
from prefill_node.metrics import PrefillMetrics
from prefill_node.options import PrefillOptions
from prefill_node.server import PrefillServer
from protocol.curve import plane_security
from telemetry.tracing import tracer_for
from worker.gateway_links import loss_timeout_s
from worker.identity import default_worker_id, kv_model_name


def options_from_config(config: PdserveConfig) -> PrefillOptions:
    transport = config.transfer.transport
    return PrefillOptions(
        worker_id=config.prefill.worker_id or default_worker_id("prefill"),
        host=config.prefill.host,
        port=config.prefill.port,
        gateway_address=config.prefill.gateway_address,
        heartbeat_s=config.gateway.worker_heartbeat_s or 5.0,
        step_timeout_s=config.gateway.worker_step_timeout_s,
        gateway_timeout_s=loss_timeout_s(config.gateway.worker_timeout_s, config.gateway.worker_heartbeat_s or 5.0),
        transports=tuple(TRANSPORTS) if transport == "auto" else (transport,),
        transfer_deadline_s=config.transfer.lease_seconds or 30.0,  # the receiver's lease: same horizon
        drain_timeout_s=config.prefill.drain_timeout_s,
        max_frame_bytes=config.transfer.max_frame_bytes,
    )


def resolve_model_path(config: PdserveConfig) -> str:
    return str(resolve_model(config.model.path, config.model.cache_dir))


def prefill_engine_config(config: PdserveConfig) -> EngineConfig:
    """The engine settings of a prefill worker: the cluster's, less speculation. A prefill worker samples
    only each prompt's first token and never runs a decode step, so a draft model (and its KV pool, as
    large as the target's) would be loaded for nothing; the decode workers, which speculate, build it."""
    return dataclasses.replace(config.engine, speculative_config="")


def build_prefill_server(
    config: PdserveConfig, ctx: zmq.Context, registry: CollectorRegistry | None = None
) -> PrefillServer:
    """Raises ClusterKeyError (before loading the model) without a usable cluster key."""
    security = plane_security(config.transfer.cluster_key_file, config.transfer.insecure, "prefill")
    engine = build_engine(resolve_model_path(config), config.model, prefill_engine_config(config), lora_cfg=config.lora)
    metrics = PrefillMetrics(registry or CollectorRegistry(), config.model.name_for_clients())
    options = options_from_config(config)
    tracer = tracer_for("prefill", options.worker_id, config.observability.otlp_traces_endpoint)
    return PrefillServer(engine, kv_model_name(config.model.path), ctx, options, metrics, security, tracer)
