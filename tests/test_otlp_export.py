"""OTLP trace export over both protocols, against real receivers that decode with opentelemetry-proto: the
OTEL_EXPORTER_OTLP_* variables read as the OTel SDKs read them, headers arriving as HTTP headers or gRPC
metadata, the one queue and drop rule for both, and a clear start-up error where grpcio is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme

from configs.schema import EX_CONFIG, ConfigError
from telemetry.otlp_export import OtlpExporter, exporter_for
from telemetry.otlp_grpc import GrpcSender, grpc_target
from telemetry.otlp_http import HttpSender
from telemetry.otlp_settings import otlp_settings
from telemetry.span import Span
from telemetry.tracing import NO_TRACING, tracer_for
from tests.cluster_harness import free_port
from tests.model_factory import tiny_model_dir
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver

ROOT = Path(__file__).resolve().parents[1]
RECEIVERS = {"http/protobuf": OtlpReceiver, "grpc": OtlpGrpcReceiver}
SENDERS = {"http/protobuf": HttpSender, "grpc": GrpcSender}
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def wait_for_spans(receiver, count: int, timeout_s: float = 30.0) -> None:
    give_up = time.monotonic() + timeout_s
    while len(receiver.spans) < count and time.monotonic() < give_up:
        time.sleep(0.05)


@pytest.mark.parametrize(
    "variable, compression",
    [("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "none"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "gzip")],
)
@pytest.mark.parametrize("protocol", list(RECEIVERS))
def test_each_protocol_delivers_the_trace_and_the_headers(protocol, variable, compression):
    receiver = RECEIVERS[protocol]()
    env = {
        variable: protocol,
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20s3cret, X-Tenant=a=b",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": compression,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    try:
        tracer = tracer_for("prefill", "prefill-3", receiver.url, env=env)
        trace = tracer.request("prefill", f"00-{TRACE_ID}-{PARENT_ID}-01", rid="r9")
        trace.phase("queue")
        trace.phase("prefill")
        trace.span("chunk", time.time_ns(), num_tokens=64)
        trace.end()
        wait_for_spans(receiver, 4)
        tracer.exporter.shutdown()
    finally:
        receiver.close()
    spans = receiver.spans
    assert sorted(s.name for s in spans) == ["chunk", "prefill", "prefill", "queue"]
    assert {(s.service, s.trace_id) for s in spans} == {("pdserve-prefill", TRACE_ID)}
    [root] = [s for s in spans if s.parent_span_id == PARENT_ID]
    assert root.attributes == {"rid": "r9"} and root.error is None
    headers = [{k.lower(): v for k, v in h.items()} for h in receiver.headers]
    assert headers and all(h["authorization"] == "Bearer s3cret" and h["x-tenant"] == "a=b" for h in headers)
    if protocol == "http/protobuf":  # gRPC compresses inside its framing, below what a handler sees
        assert {h.get("content-encoding", "none") for h in headers} == {compression}


@pytest.mark.parametrize("protocol", list(RECEIVERS))
def test_https_endpoints_are_tls_checked_against_the_certificate_variable(protocol, tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    receiver = RECEIVERS[protocol](server_cert=ca.issue_cert("localhost"))
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "5000"}
    try:
        # the system's roots do not know this CA: the handshake fails and the batch is lost
        untrusted = exporter_for(otlp_settings(receiver.url, env), {"service.name": "t"})
        untrusted.add(Span("s", bytes(16), bytes(7) + b"\1", b"", 1, 2))
        untrusted.flush()
        assert (untrusted.num_failed_sends, receiver.spans) == (1, [])
        untrusted.shutdown()
        trusting = {**env, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "ca.pem")}
        exporter = exporter_for(otlp_settings(receiver.url, trusting), {"service.name": "t"})
        exporter.add(Span("s", bytes(15) + b"\1", bytes(7) + b"\1", b"", 1, 2))
        exporter.flush()
        exporter.shutdown()
    finally:
        receiver.close()
    assert exporter.num_failed_sends == 0 and [s.name for s in receiver.spans] == ["s"]


@pytest.mark.parametrize("protocol", list(RECEIVERS))
def test_a_full_queue_drops_and_a_missing_collector_loses_the_batch_without_raising(protocol):
    def span(i: int) -> Span:
        return Span(f"s{i}", bytes(15) + b"\1", i.to_bytes(8, "big"), b"", time.time_ns(), time.time_ns() + 1)

    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
    nobody = otlp_settings(f"http://127.0.0.1:{free_port()}/v1/traces", env)
    exporter = OtlpExporter(SENDERS[protocol](nobody), {"service.name": "t"}, delay_s=3600, max_queue=3, timeout_s=5)
    for i in range(5):
        exporter.add(span(i))
    assert exporter.num_dropped == 2
    exporter.flush()
    assert exporter.num_failed_sends == 1
    exporter.shutdown()

    receiver = RECEIVERS[protocol]()
    try:
        live = otlp_settings(receiver.url, env)
        exporter = OtlpExporter(SENDERS[protocol](live), {"service.name": "t"}, delay_s=3600, max_queue=3)
        for i in range(5):
            exporter.add(span(i))
        exporter.shutdown()  # sends what is queued
    finally:
        receiver.close()
    assert sorted(s.name for s in receiver.spans) == ["s0", "s1", "s2"]
    assert (exporter.num_dropped, exporter.num_failed_sends) == (2, 0)


def test_settings_follow_the_otel_variables():
    grpc = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert otlp_settings("", {}) is None and tracer_for("decode", "d", "", env={}) is NO_TRACING
    assert otlp_settings("", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) is None  # no endpoint: no opinion
    # the generic endpoint is a base URL for HTTP, the target itself for gRPC; the signal's own wins
    assert otlp_settings("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}).endpoint == "http://c:4318/v1/traces"
    assert otlp_settings("", {**grpc, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}).endpoint == "http://c:4317"
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}
    assert otlp_settings("", both).endpoint == "http://t/x"
    assert otlp_settings("http://flag/v1/traces", both).endpoint == "http://flag/v1/traces"
    # per-signal variables win over the generic ones, whole (headers are not merged)
    env = {
        **grpc,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2,broken,=3",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_BSP_SCHEDULE_DELAY": "250",
    }
    s = otlp_settings("https://c/v1/traces", env)
    assert (s.protocol, s.headers, s.timeout_s, s.delay_s, s.tls) == ("http/protobuf", (("b", "2"),), 2.5, 0.25, True)
    assert otlp_settings("http://c", {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "soon"}).timeout_s == 10.0
    # gRPC: the scheme says plaintext or TLS; without one, TLS unless INSECURE
    assert [
        otlp_settings(endpoint, {**grpc, **extra}).tls
        for endpoint, extra in (
            ("http://h:4317", {}),
            ("https://h:4317", {}),
            ("h:4317", {}),
            ("h:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}),
        )
    ] == [False, True, True, False]
    assert [grpc_target(e) for e in ("http://h:4317/v1/traces", "h:4317", "https://[::1]:4317")] == [
        "h:4317",
        "h:4317",
        "[::1]:4317",
    ]


@pytest.mark.parametrize(
    "endpoint, env, message",
    [
        ("http://c/v1/traces", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "'http/json' is not supported"),
        ("http://c/v1/traces", {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "COMPRESSION='zstd' is not supported"),
        ("collector:4318", {}, "'collector:4318' (http/protobuf) needs an http:// or https:// URL"),
        ("ftp://c:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "'ftp://c:4317' (grpc) needs an http://"),
        (
            "https://c:4317",
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"},
            "OTLP traces certificate '/nonexistent/ca.pem': ",
        ),
    ],
)
def test_settings_no_exporter_can_use_are_a_config_error(endpoint, env, message):
    with pytest.raises(ConfigError) as refused:
        tracer_for("gateway", "gateway", endpoint, env=env)
    assert message in str(refused.value)


def test_grpc_without_grpcio_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "grpc", None)  # what `import grpc` meets where it is not installed
    monkeypatch.delitem(sys.modules, "telemetry.otlp_grpc")
    with pytest.raises(ConfigError) as refused:
        tracer_for("decode", "d", "http://c:4317", env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    assert "needs the grpcio package" in str(refused.value) and "pip install 'pdserve[otlp-grpc]'" in str(refused.value)


@pytest.mark.parametrize("role, prefix", [("gateway", "pdserve gateway: "), ("decode", "config error: ")])
def test_a_role_without_grpcio_stops_at_start_with_one_line(tmp_path, role, prefix):
    # a grpc package that fails to import, first on the path: a host where grpcio is not installed
    (tmp_path / "grpc").mkdir()
    (tmp_path / "grpc" / "__init__.py").write_text("raise ImportError(\"No module named 'grpc'\")\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))},
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
    }
    argv = ["-m", "cluster", role, "--set", f"model.path={tiny_model_dir('llama')}", "--port", "0"]
    argv += ["--otlp-traces-endpoint", "http://127.0.0.1:4317", "--set", "transfer.insecure=true"]
    argv += ["--set", "gateway.worker_port=0"]
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == EX_CONFIG, result.stderr
    assert result.stderr.splitlines()[-1] == prefix + (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc needs the grpcio package (No module named "
        "'grpc'): pip install 'pdserve[otlp-grpc]', or export over http/protobuf (the collector's port 4318)"
    ), result.stderr
    if role == "decode":  # a worker checks before its model loads: nothing else happened
        assert len(result.stderr.splitlines()) == 1, result.stderr
