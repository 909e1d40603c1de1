"""The pieces behind logs and traces, each against an independent expectation: JSON log lines parsed
back, vLLM's stats line from known counter moves, our OTLP encoding decoded by opentelemetry-proto,
W3C traceparent parsing, and traces posted to a real receiver (or nothing made when tracing is off)."""

from __future__ import annotations

import io
import json
import logging
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry

from telemetry.logs import JsonFormatter
from telemetry.otlp import encode_request
from telemetry.span import KIND_SERVER, Span, parse_traceparent
from telemetry.tracing import NO_TRACING, tracer_for
from tests.otlp_receiver import OtlpReceiver
from worker.metrics import EngineMetrics, EngineSnapshot
from worker.stats_log import StatsLog


def test_json_log_lines_carry_role_worker_and_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("decode", "decode-0"))
    logger = logging.getLogger("test.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.warning("rid=cmpl-abc-0 failed: %s", "deadline exceeded")
        logger.info("pool ready", extra={"request_id": None})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("step failed")
    finally:
        logger.removeHandler(handler)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert {k: first[k] for k in ("level", "role", "worker_id", "request_id", "message")} == {
        "level": "WARNING",
        "role": "decode",
        "worker_id": "decode-0",
        "request_id": "cmpl-abc-0",
        "message": "rid=cmpl-abc-0 failed: deadline exceeded",
    }
    assert second["request_id"] is None and second["time"].endswith("+00:00")
    assert "ValueError: boom" in third["exception"]


def test_stats_line_reports_what_moved_in_the_interval():
    registry, now = CollectorRegistry(), [0.0]
    metrics = EngineMetrics(registry, "m")
    stats = StatsLog(registry, "m", "pdserve:prompt_tokens_total", clock=lambda: now[0])
    assert stats.tick() is None  # idle
    metrics.prompt_tokens.inc(1000)
    metrics.generation_tokens.inc(50)
    metrics.update(EngineSnapshot(3, 1, 200, 50, 150, 400, 100, 0))
    now[0] = 4.0
    assert stats.tick() is None  # not yet 10 s
    now[0] = 10.0
    line = stats.tick()
    assert line == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    metrics.update(EngineSnapshot(0, 0, 200, 0, 200, 400, 100, 0))
    now[0] = 25.0
    assert stats.tick() is None  # nothing moved, nothing running: quiet


def test_otlp_encoding_decodes_with_the_reference_protobuf():
    span = Span(
        "kv_push",
        bytes(range(16)),
        bytes(range(8)),
        bytes(range(8, 16)),
        1_000,
        2_500,
        KIND_SERVER,
        {"num_blocks": 3, "transport": "shm", "ratio": 0.5, "ok": True, "neg": -7},
        error="receiver gone",
    )
    decoded = ExportTraceServiceRequest.FromString(encode_request({"service.name": "pdserve-prefill"}, [span]))
    [resource_spans] = decoded.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "pdserve-prefill"
    [scope_spans] = resource_spans.scope_spans
    assert scope_spans.scope.name == "pdserve"
    [s] = scope_spans.spans
    assert (s.name, s.trace_id, s.span_id, s.parent_span_id) == (
        "kv_push",
        bytes(range(16)),
        bytes(range(8)),
        bytes(range(8, 16)),
    )
    assert (s.kind, s.start_time_unix_nano, s.end_time_unix_nano) == (s.SPAN_KIND_SERVER, 1_000, 2_500)
    values = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in s.attributes}
    assert values == {"num_blocks": 3, "transport": "shm", "ratio": 0.5, "ok": True, "neg": -7}
    assert (s.status.code, s.status.message) == (s.status.STATUS_CODE_ERROR, "receiver gone")


def test_traceparent_parsing_follows_w3c():
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{tid}-{sid}-01") == (bytes.fromhex(tid), bytes.fromhex(sid))
    assert parse_traceparent(f"00-{tid.upper()}-{sid}-00") == (bytes.fromhex(tid), bytes.fromhex(sid))
    for bad in (
        "",
        "garbage",
        f"ff-{tid}-{sid}-01",
        f"00-{'0' * 32}-{sid}-01",
        f"00-{tid}-{'0' * 16}-01",
        f"00-{tid}-{sid}-01" + "x" * 100,
    ):
        assert parse_traceparent(bad) is None, bad


def test_traces_reach_a_receiver_and_nothing_is_made_when_off():
    assert NO_TRACING.request("decode", "") is None and not NO_TRACING.enabled
    assert tracer_for("decode", "d", "", env={}) is NO_TRACING
    receiver = OtlpReceiver()
    try:
        tracer = tracer_for("decode", "decode-7", receiver.url, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
        trace = tracer.request("decode", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", rid="r1")
        trace.phase("reserve")
        trace.phase("decode")
        trace.span("chunk", time.time_ns(), num_tokens=16)
        trace.end("deadline exceeded")
        trace.end()  # only the first end counts
        give_up = time.monotonic() + 30
        while len(receiver.spans) < 4 and time.monotonic() < give_up:
            time.sleep(0.05)
        tracer.exporter.shutdown()
        spans = {s.name: s for s in receiver.spans}
        assert sorted(spans) == ["chunk", "decode", "reserve"] and len(receiver.spans) == 4
        root = next(s for s in receiver.spans if s.name == "decode" and s.parent_span_id == "00f067aa0ba902b7")
        assert (
            root.service == "pdserve-decode" and root.error == "deadline exceeded" and root.attributes == {"rid": "r1"}
        )
        phases = {s.name: s for s in receiver.spans if s.parent_span_id == root.span_id}
        assert sorted(phases) == ["decode", "reserve"]
        assert spans["chunk"].parent_span_id == phases["decode"].span_id  # inside the phase open then
        assert all(s.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" for s in receiver.spans)
    finally:
        receiver.close()


def test_request_report_line_and_span_attributes():
    from gateway.metrics import ChoiceTiming
    from gateway.serving.request_report import RequestReport

    usage = {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}
    timings = [ChoiceTiming(0.01, 100.25, 100.5, 6, "length"), ChoiceTiming(0.01, 100.125, 100.75, 3, None)]
    report = RequestReport.of("cmpl-1", "X", "aborted", usage, timings, ["decode-0", "prefill-1"], 100.0, 101.0)
    assert report.log_line() == (
        "rid=cmpl-1 finished: model=X outcome=aborted prompt_tokens=40 cached_tokens=32 "
        "output_tokens=9 ttft=0.125s e2e=1.000s finish=length,- workers=decode-0,prefill-1"
    )
    assert report.error is None  # a client leaving is not an error
    failed = RequestReport.of("cmpl-2", "X", "failed", usage, [ChoiceTiming(0.0, None, None, 0, None)], [], 5.0, 5.5)
    assert "ttft=- e2e=0.500s finish=- workers=-" in failed.log_line() and failed.error == "failed"
    assert failed.span_attributes()["pdserve.outcome"] == "failed"


def test_gateway_traces_every_request_refused_ones_included(tok_dir):
    import httpx

    from tests.fake_backend import API_KEYS, MODEL, live_gateway

    receiver = OtlpReceiver()
    tracer = tracer_for("gateway", "gateway", receiver.url, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        with live_gateway(tok_dir, tracer=tracer) as live:
            headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
            bad = httpx.post(
                f"{live.base_url}/v1/completions",
                headers=headers,
                json={"model": MODEL, "prompt": "Hi", "max_tokens": "many"},
            )
            ok = httpx.post(
                f"{live.base_url}/v1/chat/completions",
                headers=headers,
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
            )
            assert (bad.status_code, ok.status_code) == (400, 200)
            give_up = time.monotonic() + 30
            while (
                len({s.trace_id for s in receiver.spans if s.parent_span_id == ""}) < 2 and time.monotonic() < give_up
            ):
                time.sleep(0.05)
        tracer.exporter.shutdown()
        roots = {s.name: s for s in receiver.spans if s.parent_span_id == ""}
        assert sorted(roots) == ["POST /v1/chat/completions", "POST /v1/completions"]
        refused = [s for s in receiver.spans if s.trace_id == roots["POST /v1/completions"].trace_id]
        assert sorted((s.name, s.error is not None) for s in refused) == [
            ("POST /v1/completions", True),
            ("parse", True),
        ]
        assert "max_tokens" in roots["POST /v1/completions"].error
        served = {s.name for s in receiver.spans if s.trace_id == roots["POST /v1/chat/completions"].trace_id}
        assert served == {"POST /v1/chat/completions", "parse", "tokenize", "generate", "stream"}
        assert roots["POST /v1/chat/completions"].attributes["gen_ai.usage.completion_tokens"] == 3
    finally:
        receiver.close()
