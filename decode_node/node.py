"""Wires one decode worker process from the config: engine, KV receiver, sockets, HTTP, metrics.

``DecodeNode.start(config)`` builds everything and binds every port (port 0: any free one); the
caller runs ``node.server.run()`` on the thread that owns the sockets and calls ``close()`` after.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry

from configs.model_source import resolve_model
from configs.schema import PdserveConfig
from decode_node.prefill_links import PrefillLinks
from decode_node.server import DecodeOptions, DecodeServer
from decode_node.speculation import SpecDecodeCollector
from engine.llm import build_engine
from kvtransfer.channel import ZmqServer
from kvtransfer.compat import new_incarnation
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.shm_pool import SharedTensor, ShmCapacityError, create_shared
from protocol.curve import PlaneSecurity, plane_security
from protocol.rejects import RejectLog
from telemetry.tracing import tracer_for
from worker import EngineMetrics, GatewayLinks, HttpHandle, default_worker_id, kv_model_name, serve_http
from worker.gateway_links import loss_timeout_s

log = logging.getLogger(__name__)


def _keep_with_sequence(block_ids: list[int]) -> None:
    """The receiver's release callback. Reserved blocks stay in their request's block table the whole
    time; the server frees them through the block manager when it handles the failure or abort."""


@dataclass(slots=True)
class DecodeNode:
    server: DecodeServer
    receiver: KVReceiver
    http: HttpHandle
    registry: CollectorRegistry
    ctx: zmq.Context
    shm_pool: SharedTensor | None = None  # the KV pool's /dev/shm file when the shm transport is offered
    security: PlaneSecurity | None = None

    @classmethod
    def start(cls, config: PdserveConfig, ctx: zmq.Context | None = None) -> DecodeNode:
        """Raises ClusterKeyError (before loading the model) without a usable cluster key."""
        security = plane_security(config.transfer.cluster_key_file, config.transfer.insecure, "decode")
        ctx = ctx or zmq.Context()
        dc = config.decode
        model_path = resolve_model(config.model.path, config.model.cache_dir)
        engine = build_engine(str(model_path), config.model, config.engine, lora_cfg=config.lora)
        registry = CollectorRegistry()
        shm_pool = share_pool(engine.runner.kv_pool, config.transfer.transport)
        kv_server = ZmqServer(ctx, dc.host, dc.kv_port, max_msg_size=config.transfer.max_frame_bytes, security=security)
        transfer_metrics = TransferMetrics(registry)
        rejects = RejectLog(log, transfer_metrics.count_rejected)  # one per process: the loop's and the plane's
        receiver = KVReceiver(
            engine.runner.kv_pool,
            kv_model_name(config.model.path),
            kv_server,
            _keep_with_sequence,
            transfer_metrics,
            lease_s=config.transfer.lease_seconds,
            shm_pool_name=shm_pool.name if shm_pool else None,
            rejects=rejects,
        )
        worker_id = dc.worker_id or default_worker_id("decode")
        options = DecodeOptions(
            worker_id,
            kv_server.endpoint,
            new_incarnation(),
            heartbeat_s=config.gateway.worker_heartbeat_s or 5.0,
            step_timeout_s=config.gateway.worker_step_timeout_s,
            drain_timeout_s=dc.drain_timeout_s,
            idle_prefill_threads=dc.idle_prefill_threads,
        )
        gateway = GatewayLinks(
            ctx,
            dc.gateway_address,
            worker_id,
            resolve_interval_s=options.heartbeat_s,
            timeout_s=loss_timeout_s(config.gateway.worker_timeout_s, options.heartbeat_s),
            security=security,
        )
        server = DecodeServer(
            engine,
            gateway,
            receiver,
            PrefillLinks(ctx, worker_id, security),
            EngineMetrics(registry, config.model.name_for_clients()),
            options,
            rejects,
            tracer_for("decode", worker_id, config.observability.otlp_traces_endpoint),
        )
        if engine.scheduler.speculator is not None:
            registry.register(SpecDecodeCollector(engine.scheduler.speculator, config.model.name_for_clients()))
        http = serve_http(dc.host, dc.http_port, registry, server.is_ready)
        log.info(
            "decode worker %s: kv %s, http %s:%d, gateway %s, %d KV blocks of %d tokens",
            worker_id,
            kv_server.endpoint,
            dc.host,
            http.port,
            dc.gateway_address,
            engine.block_manager.num_blocks,
            engine.block_manager.block_size,
        )
        return cls(server, receiver, http, registry, ctx, shm_pool, security)

    def close(self) -> None:
        self.http.close()
        self.server.gateway.close()
        self.server.prefill.close()
        self.receiver.close()
        if self.security is not None:
            self.security.close()
        if self.shm_pool is not None:
            self.shm_pool.unlink()  # peers that mapped it keep their mapping; the name goes now


def share_pool(pool, transport: str) -> SharedTensor | None:
    """Move a CPU KV pool into /dev/shm so a same-host prefill worker writes straight into reserved
    blocks (the shm transport). The file name carries our pid: a supervisor that sees this process
    die removes ``pdserve-*-<pid>-*`` (cluster/local_cluster.py). Where /dev/shm cannot hold it, the
    pool stays where it is and peers get the zmq transport (a warning names both sizes)."""
    if transport not in ("auto", "shm") or pool.tensor.is_cuda:
        return None
    try:
        shared = create_shared(pool.layout.shape, pool.layout.dtype, prefix=f"kv-{os.getpid()}")
    except ShmCapacityError as e:
        log.warning(
            "KV pool not shared (%s); prefill workers on this host will use the zmq transport. "
            "Enlarge /dev/shm (docker run --shm-size, an emptyDir with medium: Memory) or shrink "
            "engine.kv_cache_memory_mb to use shm",
            e,
        )
        return None
    shared.tensor.copy_(pool.tensor)  # a fresh pool is zeros, but keep whatever was there
    pool.tensor = shared.tensor  # the runner reads pool.tensor on every step; nothing cached it yet
    return shared
