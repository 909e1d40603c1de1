"""Request traces: one span per request per process, its phases as child spans.

Off unless an OTLP endpoint is configured (observability.otlp_traces_endpoint, or the OTEL_EXPORTER_OTLP_*
variables: ``otlp_settings``): when off ``Tracer.request`` returns None and the call sites, which
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

from telemetry.otlp_export import OtlpExporter, check_usable, exporter_for
from telemetry.otlp_settings import otlp_settings
from telemetry.span import KIND_INTERNAL, KIND_SERVER, Span, parse_traceparent

log = logging.getLogger(__name__)


class RequestTrace:
    """A request's span in this process, with at most one phase span open at a time."""

    __slots__ = ("_exporter", "root", "_phase", "_ended")

    def __init__(self, exporter: OtlpExporter, root: Span):
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

    def __init__(self, exporter: OtlpExporter | None):
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
    """The process's tracer: exporting to ``endpoint`` (or where the OTEL variables say), else off.
    Raises ConfigError for settings it cannot export with (the process stops with one line)."""
    settings = otlp_settings(endpoint, env)
    if settings is None:
        return NO_TRACING
    resource = {"service.name": f"pdserve-{role}", "service.instance.id": worker_id, "pdserve.role": role}
    exporter = exporter_for(settings, resource)
    atexit.register(exporter.shutdown)
    log.info("tracing: OTLP %s to %s", settings.protocol, exporter.sender.target)
    return Tracer(exporter)


def check_tracing(endpoint: str, env=os.environ) -> None:
    """Raise ConfigError where ``tracer_for`` would (an unknown protocol, grpc without grpcio, ...),
    making nothing: for a process to stop before its slow start-up rather than after it."""
    settings = otlp_settings(endpoint, env)
    if settings is not None:
        check_usable(settings)


__all__ = ["KIND_SERVER", "NO_TRACING", "RequestTrace", "Tracer", "check_tracing", "tracer_for"]
