"""Request traces: one span per request per process, its phases as child spans.

Off unless an OTLP endpoint is configured (observability.otlp_traces_endpoint, or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): then ``Tracer.request`` returns None and the call sites, which
hold ``trace: RequestTrace | None``, do nothing else, so tracing costs one None check per phase.

    gateway   POST /v1/...  [parse | tokenize | generate (route) | stream]
    decode      decode      [reserve | wait_kv | decode]          or [reserve | prefill_local | decode]
    prefill       prefill   [queue | prefill (chunk, kv_push ...) | transfer]
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from telemetry.otlp import OtlpHttpExporter
from telemetry.span import KIND_INTERNAL, KIND_SERVER, Span, parse_traceparent

log = logging.getLogger(__name__)


class RequestTrace:
    """A request's span in this process, with at most one phase span open at a time."""

    __slots__ = ("_exporter", "root", "_phase", "_ended")

    def __init__(self, exporter: OtlpHttpExporter, root: Span):
        self._exporter = exporter
        self.root = root
        self._phase: Span | None = None
        self._ended = False

    def traceparent(self) -> str:
        """The context a downstream process makes its spans children of."""
        return self.root.traceparent

    def phase(self, name: str, at_ns: int | None = None, **attributes) -> None:
        """End the open phase (if any) and open ``name``, at ``at_ns`` (default: now)."""
        now = at_ns or time.time_ns()
        self._end_phase(now)
        if not self._ended:
            self._phase = self._child(name, now, attributes, self.root)

    def span(self, name: str, start_ns: int, end_ns: int | None = None, **attributes) -> None:
        """A whole span (a prefill chunk, a KV push, routing) inside the open phase, or the request's."""
        span = self._child(name, start_ns, attributes, self._phase or self.root)
        span.end_ns = end_ns if end_ns is not None else time.time_ns()
        self._exporter.add(span)

    def set(self, **attributes) -> None:
        self.root.attributes.update(attributes)

    def end(self, error: str | None = None, **attributes) -> None:
        """End the open phase and the request span; only the first call counts."""
        if self._ended:
            return
        self._ended = True
        now = time.time_ns()
        self._end_phase(now, error)
        self.root.attributes.update(attributes)
        self.root.end_ns, self.root.error = now, error
        self._exporter.add(self.root)

    def _child(self, name: str, start_ns: int, attributes: dict, parent: Span) -> Span:
        return Span(name, self.root.trace_id, os.urandom(8), parent.span_id, start_ns, attributes=attributes)

    def _end_phase(self, now: int, error: str | None = None) -> None:
        if self._phase is not None:
            self._phase.end_ns, self._phase.error = now, error
            self._exporter.add(self._phase)
            self._phase = None


class Tracer:
    """Starts request traces for one process; ``Tracer(None)`` (NO_TRACING) starts none."""

    def __init__(self, exporter: OtlpHttpExporter | None):
        self.exporter = exporter

    @property
    def enabled(self) -> bool:
        return self.exporter is not None

    def request(
        self, name: str, traceparent: str = "", *, kind: int = KIND_INTERNAL, start_ns: int | None = None, **attributes
    ) -> RequestTrace | None:
        """A request's span, child of ``traceparent`` when that is valid, else a new trace's root."""
        if self.exporter is None:
            return None
        parent = parse_traceparent(traceparent)
        trace_id, parent_id = parent if parent is not None else (os.urandom(16), b"")
        root = Span(
            name, trace_id, os.urandom(8), parent_id, start_ns or time.time_ns(), kind=kind, attributes=attributes
        )
        return RequestTrace(self.exporter, root)


NO_TRACING = Tracer(None)


def tracer_for(role: str, worker_id: str, endpoint: str, env=os.environ) -> Tracer:
    """The process's tracer: exporting to ``endpoint`` (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), else off."""
    endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    if not endpoint:
        return NO_TRACING
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    if protocol != "http/protobuf":
        log.error("OTLP protocol %r is not supported (only http/protobuf): tracing is off", protocol)
        return NO_TRACING
    resource = {"service.name": f"pdserve-{role}", "service.instance.id": worker_id, "pdserve.role": role}
    try:
        delay_s = max(float(env.get("OTEL_BSP_SCHEDULE_DELAY", "1000")) / 1000, 0.01)
    except ValueError:
        log.warning(
            "OTEL_BSP_SCHEDULE_DELAY=%r is not a number of milliseconds; using 1000", env["OTEL_BSP_SCHEDULE_DELAY"]
        )
        delay_s = 1.0
    exporter = OtlpHttpExporter(
        endpoint, resource, _headers(env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "")), delay_s=delay_s
    )
    atexit.register(exporter.shutdown)
    log.info("tracing: OTLP/HTTP protobuf to %s", endpoint)
    return Tracer(exporter)


def _headers(text: str) -> dict[str, str]:
    """OTEL's ``key=value,key2=value2`` (e.g. an Authorization header for a hosted collector)."""
    pairs = (part.split("=", 1) for part in text.split(",") if "=" in part)
    return {k.strip(): v.strip() for k, v in pairs}


__all__ = ["KIND_SERVER", "NO_TRACING", "RequestTrace", "Tracer", "tracer_for"]
