"""The gateway's circuit breaker blames the peer that failed, with real processes (``pdserve serve``, CURVE
on, 1 prefill + 1 decode worker) and a key holder registered as a second prefill worker that never
delivers the KV of the jobs it gets: it sits on them, or it advertises an address where nothing answers
(a closed port, a blackholed network). Each failed attempt ends within the decode worker's lease
(LEASE_S), its blocks come back, the gateway blames that prefill worker (never the decode worker, which
only waited for it) and retries on the real one: every client gets the single engine's exact text.
After ``breaker_threshold`` (3) failures in a row its breaker opens and it gets no more jobs.

The other way round: a decode worker (in this process, joined to the cluster with the key) whose KV
address blackholes. The prefill worker's handshake with it gives up, its PrefillFailed says the decode
worker's receiver did not answer, and the gateway blames that decode worker, never the prefill worker,
and retries on decode-0."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
import zmq

from cluster.keygen import write_private_key
from configs.loader import load_config
from decode_node.node import DecodeNode
from engine.llm import LLM
from tests import hostile
from tests.cluster_harness import ServeProcess
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.test_hostile_peers import BLOCK, complete, endpoints, expected, gateway_metric, prompt_of

KEY_FILE = write_private_key()
LEASE_S = 2.0
THRESHOLD = 3  # gateway/workers/zmq_backend.py ZmqBackendParams.breaker_threshold


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("blame"),
        engine={"block_size": BLOCK, "kv_cache_memory_mb": 8},
        # every prompt goes through a prefill worker; decode workers in turn (a second one joins below)
        gateway={"local_prefill_max_tokens": 0, "routing_policy": "round_robin"},
        transfer={"cluster_key_file": KEY_FILE, "lease_seconds": LEASE_S},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def reference():
    return LLM(str(tiny_model_dir("llama")), block_size=BLOCK)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def breaker(cluster, worker_id: str) -> tuple[float, float]:
    """(failures the gateway blamed on the worker, 1 while its breaker is open)."""
    label = f'{{worker_id="{worker_id}"}}'
    return (
        gateway_metric(cluster, f"pdserve:worker_failures_total{label}"),
        gateway_metric(cluster, f"pdserve:worker_breaker_open{label}"),
    )


def jobs_of(cluster, worker: str) -> float:
    return cluster.metric(worker, "pdserve:prefill_jobs_total")


@pytest.mark.parametrize(
    "name, address",
    [
        ("a-silent-prefill", None),  # takes the jobs, never writes
        ("a-closed-port", "tcp://127.0.0.1:9"),  # discard port: nothing listens on loopback
        ("a-blackhole", "tcp://192.0.2.1:8100"),  # TEST-NET-1 (RFC 5737): routable nowhere
    ],
)
def test_a_prefill_worker_that_never_delivers_is_blamed_and_the_decode_worker_serves_on(
    cluster, reference, ctx, name, address
):
    complete(cluster, prompt_of(2 * BLOCK + 3, seed=99))  # connections between the real workers are up
    cluster.wait_idle()
    pids = dict(cluster.worker_pid)
    expired = cluster.metric("decode-0", "pdserve:kv_lease_expired_total")
    fake = hostile.SilentPrefill(ctx, endpoints(cluster)["gateway"], hostile.key_holder(KEY_FILE), name, address)
    try:
        cluster.wait_until(lambda: cluster.registered(name), f"{name} registered")
        for attempt in range(1, THRESHOLD + 1):
            prompt = prompt_of(3 * BLOCK + attempt, seed=len(name) * 10 + attempt)
            assert complete(cluster, prompt) == expected(reference, prompt)  # retried on prefill-0
            assert breaker(cluster, name) == (attempt, 1.0 if attempt == THRESHOLD else 0.0)
            assert breaker(cluster, "decode-0")[0] == 0 and breaker(cluster, "prefill-0")[0] == 0
        assert cluster.metric("decode-0", "pdserve:kv_lease_expired_total") == expired + THRESHOLD
        if address is None:
            assert fake.num_jobs == THRESHOLD
        # Open: the next request goes to prefill-0 at once, and the decode worker's breaker never moved.
        served = jobs_of(cluster, "prefill-0")
        prompt = prompt_of(3 * BLOCK + 9, seed=len(name))
        assert complete(cluster, prompt) == expected(reference, prompt)
        assert jobs_of(cluster, "prefill-0") == served + 1
        assert cluster.metric("decode-0", "pdserve:kv_lease_expired_total") == expired + THRESHOLD
        assert gateway_metric(cluster, 'pdserve:worker_breaker_open{worker_id="decode-0"}') == 0
    finally:
        fake.close()
    cluster.wait_until(lambda: not cluster.registered(name), f"{name} left")
    assert breaker(cluster, name) == (0.0, 0.0)  # its series went with it
    assert cluster.worker_pid == pids and {w["id"] for w in cluster.wait_idle()} == {"prefill-0", "decode-0"}
    assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200
    assert os.path.exists(KEY_FILE)


def joined_decode_worker(cluster, ctx, worker_id: str) -> DecodeNode:
    """A decode worker of this process, registered with the cluster's gateway under the cluster key.
    Its lease stays the default 30 s: longer than a prefill worker's 5 s handshake timeout."""
    config = load_config(
        None,
        env={},
        overrides={
            "model.path": str(tiny_model_dir("llama")),
            "engine.block_size": BLOCK,
            "engine.kv_cache_memory_mb": 8,
            "engine.num_threads": 1,
            "decode.gateway_address": endpoints(cluster)["gateway"],
            "decode.kv_port": 0,
            "decode.http_port": 0,
            "decode.worker_id": worker_id,
            "gateway.worker_heartbeat_s": 0.2,
            "transfer.cluster_key_file": KEY_FILE,
        },
    )
    return DecodeNode.start(config, ctx)


def test_a_decode_worker_whose_kv_address_blackholes_is_blamed_not_the_prefill_worker(cluster, reference, ctx):
    name = "a-blackholed-decode"
    node = joined_decode_worker(cluster, ctx, name)
    node.server.options.kv_address = "tcp://127.0.0.1:9"  # what it tells the gateway, and prefill workers
    loop = threading.Thread(target=node.server.run, daemon=True)
    loop.start()
    try:
        cluster.wait_until(lambda: cluster.registered(name), f"{name} registered")
        for seed in range(100, 110):  # every other request is routed to it until its breaker opens
            prompt = prompt_of(3 * BLOCK + 5, seed=seed)
            assert complete(cluster, prompt) == expected(reference, prompt)  # retried on decode-0
            if breaker(cluster, name)[1] == 1:
                break
        assert breaker(cluster, name) == (THRESHOLD, 1.0)
        assert breaker(cluster, "prefill-0")[0] == 0 and breaker(cluster, "decode-0")[0] == 0
        assert cluster.metric("prefill-0", 'pdserve:kv_handshakes_total{result="failed"}') >= 1
        cluster.wait_until(lambda: not node.server.requests, f"{name} holds no request")
    finally:
        node.server.request_drain()  # says goodbye to the gateway
        loop.join(timeout=60)
        bm = node.server.block_manager
        node.close()
    assert_no_leak(bm)
    cluster.wait_until(lambda: not cluster.registered(name), f"{name} left")
    assert {w["id"] for w in cluster.wait_idle()} == {"prefill-0", "decode-0"}
