"""pdserve as a vLLM operator meets it (issue 31's "done when"): `pdserve serve` with vLLM's flags, then
/v1/models, the context limit, token-id prompts with an added special token, every vLLM metric family
with model_name at the cluster's /metrics endpoints (the pools' engine gauges at the gateway too), one
trace per request with spans from all three processes at a real OTLP/HTTP receiver and at a real
OTLP/gRPC one, and JSON log lines, with PDSERVE_* environment variables still honoured beside the flags."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests import prom
from tests.cluster_harness import ServeProcess
from tests.model_factory import ADDED_IN_GAP_ID, added_tokens_model_dir, tiny_model_dir
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver

MODEL = "X"
POOLS = ("prefill", "decode")
CLIENT_TRACE_ID, CLIENT_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

GATEWAY_FAMILIES = (
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)
WORKER_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver):
    serve = ServeProcess(
        added_tokens_model_dir(),  # a tokenizer laid out as Qwen's: added special tokens above the base vocabulary
        tmp_path_factory.mktemp("dropin"),
        extra_args=(
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "256",
            "--otlp-traces-endpoint",
            receiver.url,
            "--log-format",
            "json",
            "--block-size",
            "16",
            "--kv-cache-memory-bytes",
            "8MiB",
        ),
        # env still counts beside the flags: every prompt goes through the prefill worker, and the flag
        # wins over the variable for the same field
        env={
            "PDSERVE_GATEWAY_LOCAL_PREFILL_MAX_TOKENS": "0",
            "PDSERVE_MODEL_SERVED_MODEL_NAME": "from-env",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def prompt_of(length: int, seed: int) -> list[int]:
    """Ids of the base vocabulary (added_tokens_model_dir's 0..699; tiny llama's too)."""
    return torch.randint(5, 700, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        return response.read().decode()


def test_vllm_operator_gets_names_limits_metrics_traces_and_logs(cluster, receiver):
    client = httpx.Client(base_url=cluster.url, timeout=120)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]

    too_long = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt_of(300, 1), "max_tokens": 1})
    assert too_long.status_code == 400
    assert "prompt has 300 tokens; this model's context is 256" in too_long.json()["error"]["message"]

    body = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    traced = client.post(
        "/v1/completions",
        json={**body, "prompt": prompt_of(40, 2)},
        headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
    )
    assert traced.status_code == 200, traced.text
    with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt_of(37, 3), "stream": True}) as s:
        assert s.status_code == 200 and "[DONE]" in s.read().decode()
    # token ids with an added special token above the tokenizer's base vocabulary, as Qwen's chat tokens
    special = client.post("/v1/completions", json={**body, "prompt": [10, 11, ADDED_IN_GAP_ID, 12, 13]})
    assert special.status_code == 200, special.text
    assert special.json()["usage"]["prompt_tokens"] == 5

    # every vLLM family, labelled with the served name: request series at the gateway, engine series at
    # each worker; process metrics everywhere
    gateway = scrape(cluster.url)
    for family in GATEWAY_FAMILIES:
        assert prom.samples(gateway, family, model_name=MODEL), family
    assert prom.total(gateway, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 3
    assert prom.total(gateway, "vllm:prompt_tokens_total", model_name=MODEL) == 40 + 37 + 5
    assert prom.total(gateway, "vllm:generation_tokens_total", model_name=MODEL) == 18
    assert prom.samples(gateway, "process_resident_memory_bytes")
    for worker_id in ("prefill-0", "decode-0"):
        text = scrape(f"http://127.0.0.1:{cluster.worker_http[worker_id]}")
        for family in WORKER_FAMILIES:
            assert prom.samples(text, family, model_name=MODEL), (worker_id, family)
        assert prom.total(text, "vllm:prefix_cache_queries_total", model_name=MODEL) > 0, worker_id
        assert prom.samples(text, "process_cpu_seconds_total"), worker_id

    # one trace per request, spans from the three processes, linked parent to child; the refused one
    # never left the gateway, and its span says why
    traces = wait_for_traces(receiver, 3)
    [refused] = [spans for spans in traces.values() if {s.service for s in spans} == {"pdserve-gateway"}]
    assert [s.name for s in refused if s.error] == ["tokenize", "POST /v1/completions"]
    assert all("this model's context is 256" in s.error for s in refused if s.error)
    served = {t: spans for t, spans in traces.items() if spans is not refused}
    assert CLIENT_TRACE_ID in served  # the client's traceparent is honoured
    assert_one_tree_per_request(served, completion_tokens=6)
    client_root = next(s for s in served[CLIENT_TRACE_ID] if s.service == "pdserve-gateway" and not s.name.islower())
    assert client_root.parent_span_id == CLIENT_SPAN_ID
    assert receiver.content_types == {"application/x-protobuf"}

    # JSON logs: one object per line; the gateway's line per finished request names its workers
    records = [json.loads(line) for line in cluster.log if line.startswith("{")]
    finished = [r for r in records if r["role"] == "gateway" and "finished: model=X" in r["message"]]
    assert {r["request_id"] for r in finished} >= {traced.json()["id"]}
    assert all("workers=decode-0,prefill-0" in r["message"] and "prompt_tokens=" in r["message"] for r in finished)
    assert {r["worker_id"] for r in records if r["role"] == "decode"} == {"decode-0"}


POOL_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def test_the_gateway_shows_each_pools_engine_gauges_under_vllm_names(cluster):
    """One endpoint, as a vLLM user scrapes one server: running, waiting and KV usage per pool at the
    gateway, from the heartbeats, while requests decode; the workers' own series stay unlabelled by pool."""

    def gauges() -> dict[tuple[str, str], float]:
        text = scrape(cluster.url)
        return {(f, pool): prom.total(text, f, model_name=MODEL, pool=pool) for f in POOL_GAUGES for pool in POOLS}

    at_rest = scrape(cluster.url)
    for family in POOL_GAUGES:  # exactly one series per pool, from the first scrape
        assert sorted(labels["pool"] for labels, _ in prom.series(at_rest, family)) == sorted(POOLS), family
        assert all(labels["model_name"] == MODEL for labels, _ in prom.series(at_rest, family)), family
    # three long streams at a time until a scrape lands while they decode (each try is a window of
    # several heartbeats; a busy machine only widens it)
    body = {"model": MODEL, "max_tokens": 256 - 40, "temperature": 0.0, "ignore_eos": True, "stream": True}
    seen: list[dict] = []
    give_up = time.monotonic() + 120
    with ThreadPoolExecutor(3) as pool:
        while not any(v[("vllm:num_requests_running", "decode")] for v in seen):
            assert time.monotonic() < give_up, "no scrape saw a request decoding"
            streams = [pool.submit(stream_all, cluster.url, {**body, "prompt": prompt_of(40, i)}) for i in range(3)]
            while not all(s.done() for s in streams) and not any(
                v[("vllm:num_requests_running", "decode")] for v in seen
            ):
                seen.append(gauges())
            assert all(s.result() == 256 - 40 for s in streams)
    decoding = next(v for v in seen if v[("vllm:num_requests_running", "decode")])
    assert 1 <= decoding[("vllm:num_requests_running", "decode")] <= 3, decoding
    assert 0 < decoding[("vllm:kv_cache_usage_perc", "decode")] <= 1, decoding
    assert all(0 <= v[("vllm:kv_cache_usage_perc", pool)] <= 1 for v in seen for pool in POOLS)
    # at rest again, the figures are the workers' own (nothing running, no block held)
    cluster.wait_until(
        lambda: all(v == 0 for k, v in gauges().items() if k[0] != "vllm:kv_cache_usage_perc"), "the pools idle"
    )
    for pool in POOLS:
        own = f"http://127.0.0.1:{cluster.worker_http[f'{pool}-0']}"
        assert not any("pool" in labels for f in POOL_GAUGES for labels, _ in prom.series(scrape(own), f)), pool
        cluster.wait_until(
            lambda: (
                gauges()[("vllm:kv_cache_usage_perc", pool)]
                == prom.total(scrape(own), "vllm:kv_cache_usage_perc", model_name=MODEL)
            ),
            f"the gateway's {pool} KV usage is the worker's",
        )


def stream_all(url: str, body: dict) -> int:
    """Completion tokens of one streamed completion, read to the end."""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream_options": {"include_usage": True}}, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return events[-1]["usage"]["completion_tokens"]


def test_traces_over_otlp_grpc_span_the_three_processes(tmp_path):
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: the same traces reach a collector's gRPC port, with the
    headers variable as metadata, from every process of the cluster."""
    receiver = OtlpGrpcReceiver()
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path,
        extra_args=("--served-model-name", MODEL, "--max-model-len", "256", "--otlp-traces-endpoint", receiver.url),
        env={
            "PDSERVE_GATEWAY_LOCAL_PREFILL_MAX_TOKENS": "0",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20collector-key",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )
    try:
        client = httpx.Client(base_url=serve.url, timeout=120)
        body = {"model": MODEL, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        assert client.post("/v1/completions", json={**body, "prompt": prompt_of(300, 4)}).status_code == 400
        for seed in (5, 6):
            served = client.post("/v1/completions", json={**body, "prompt": prompt_of(30 + seed, seed)})
            assert served.status_code == 200, served.text
        traces = wait_for_traces(receiver, 2)
    finally:
        assert serve.stop() == 0, "".join(serve.log[-30:])
        receiver.close()
    [refused] = [t for t, spans in traces.items() if {s.service for s in spans} == {"pdserve-gateway"}]
    assert_one_tree_per_request({t: s for t, s in traces.items() if t != refused}, completion_tokens=5)
    assert {h["authorization"] for h in receiver.headers} == {"Bearer collector-key"}
    assert any("tracing: OTLP grpc to 127.0.0.1:" in line for line in serve.log)


def wait_for_traces(receiver: OtlpReceiver | OtlpGrpcReceiver, count: int, timeout_s: float = 60.0) -> dict[str, list]:
    """Trace id -> spans of every trace, once ``count`` of them hold the three processes' request spans
    and one more is the refused request's."""
    give_up = time.monotonic() + timeout_s
    while True:
        traces: dict[str, list] = {}
        for span in list(receiver.spans):
            traces.setdefault(span.trace_id, []).append(span)
        complete = {
            t: s
            for t, s in traces.items()
            if {x.name for x in s} >= {"POST /v1/completions", "decode", "prefill", "transfer", "stream"}
        }
        if len(complete) >= count or time.monotonic() > give_up:
            assert len(complete) == count == len(traces) - 1, {
                t: sorted({x.name for x in s}) for t, s in traces.items()
            }
            return traces
        time.sleep(0.2)


def assert_one_tree_per_request(served: dict[str, list], completion_tokens: int) -> None:
    """Each trace: the three processes' request spans linked gateway -> decode -> prefill, every phase
    of each, one tree with nothing dangling."""
    for spans in served.values():
        roots = {s.service: s for s in spans if s.name in ("POST /v1/completions", "decode", "prefill")}
        assert set(roots) == {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}, spans
        gateway_root, decode_root, prefill_root = (roots[f"pdserve-{r}"] for r in ("gateway", "decode", "prefill"))
        assert decode_root.parent_span_id == gateway_root.span_id
        assert prefill_root.parent_span_id == decode_root.span_id
        names = {(s.service, s.name) for s in spans}
        for service, name in (
            [("gateway", n) for n in ("parse", "tokenize", "route", "generate", "stream")]
            + [("decode", n) for n in ("reserve", "wait_kv", "decode")]
            + [("prefill", n) for n in ("queue", "prefill", "chunk", "kv_push", "transfer")]
        ):
            assert (f"pdserve-{service}", name) in names, (service, name)
        ids = {s.span_id for s in spans}
        assert all(s.start_ns <= s.end_ns and not s.error for s in spans), [
            s for s in spans if s.error or s.start_ns > s.end_ns
        ]
        assert [s for s in spans if s.parent_span_id not in ids] == [gateway_root]  # one tree, nothing dangling
        by_id = {s.span_id: s for s in spans}
        assert {by_id[s.parent_span_id].name for s in spans if s.name in ("chunk", "kv_push")} == {"prefill"}
        assert by_id[next(s for s in spans if s.name == "route").parent_span_id].name == "generate"
        assert gateway_root.attributes["gen_ai.usage.completion_tokens"] == completion_tokens
