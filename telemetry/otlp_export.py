"""Batched export of finished spans to an OTLP collector, over HTTP/protobuf or gRPC.

Spans queue in memory (at most ``max_queue``); a daemon thread sends what has finished every
``delay_s`` as one ExportTraceServiceRequest (``otlp.encode_request``). A full queue drops spans rather
than slowing requests, and a failed send loses its batch (no retry, as the OTel SDK's default for
errors it does not deem transient): both are counted, and logged at most once a minute. The two
protocols share all of that; only ``Sender.send`` differs (``otlp_http.HttpSender``, ``otlp_grpc.GrpcSender``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from configs.schema import ConfigError
from telemetry.otlp import encode_request
from telemetry.otlp_http import HttpSender
from telemetry.otlp_sender import ExportFailed, Sender
from telemetry.otlp_settings import OtlpSettings
from telemetry.span import Span

log = logging.getLogger(__name__)

EXIT_WAIT_S = 2.0
COMPLAINT_INTERVAL_S = 60.0  # a collector down for hours: one line a minute


class OtlpExporter:
    """Collects finished spans; a daemon thread hands them to ``sender`` in batches."""

    def __init__(
        self, sender: Sender, resource: dict, delay_s: float = 1.0, max_queue: int = 4096, timeout_s: float = 10.0
    ):
        self.sender = sender
        self._resource = resource
        self._delay_s, self._max_queue, self._timeout_s = delay_s, max_queue, timeout_s
        self._spans: collections.deque[Span] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.num_dropped = 0  # spans refused by a full queue
        self.num_failed_sends = 0  # batches the collector did not take
        self._last_complaint = float("-inf")
        self._num_dropped_told = 0  # num_dropped when a warning last said it
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def add(self, span: Span) -> None:
        with self._lock:
            if len(self._spans) >= self._max_queue:
                self.num_dropped += 1
                return
            self._spans.append(span)

    def _run(self) -> None:
        while not self._stop.wait(self._delay_s):
            self.flush()

    def flush(self, timeout_s: float | None = None) -> None:
        with self._lock:
            spans, self._spans = list(self._spans), collections.deque()
            num_dropped = self.num_dropped
        if not spans:
            return
        try:
            self.sender.send(encode_request(self._resource, spans), timeout_s or self._timeout_s)
        except ExportFailed as exc:
            self.num_failed_sends += 1
            self._complain("OTLP export of %d spans to %s failed: %s", len(spans), self.sender.target, exc)
        if num_dropped > self._num_dropped_told and self._complain(
            "OTLP export: %d spans dropped so far (queue of %d full)", num_dropped, self._max_queue
        ):
            self._num_dropped_told = num_dropped

    def _complain(self, *args) -> bool:
        """Log a warning unless one was logged in the last minute; True when it was logged."""
        now = time.monotonic()
        if now - self._last_complaint <= COMPLAINT_INTERVAL_S:
            return False
        self._last_complaint = now
        log.warning(*args)
        return True

    def shutdown(self) -> None:
        """Stop the thread and send what is left (at exit: the last requests' spans), waiting at most a
        few seconds on a collector that does not answer, so a drain is not held up by tracing."""
        self._stop.set()
        self._thread.join(timeout=EXIT_WAIT_S)
        self.flush(EXIT_WAIT_S)
        self.sender.close()


def check_usable(settings: OtlpSettings) -> None:
    """Raise ConfigError unless an exporter can be made for ``settings``, making nothing: gRPC needs
    grpcio (the ``otlp-grpc`` extra), a CA file must be readable. A worker checks this before it loads
    its model, so it stops at start with one line instead of dropping every trace."""
    if settings.protocol == "grpc":
        try:
            import telemetry.otlp_grpc  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc needs the grpcio package ({exc}): "
                "pip install 'pdserve[otlp-grpc]', or export over http/protobuf (the collector's port 4318)"
            ) from None
    if settings.certificate_file:
        try:
            with open(settings.certificate_file, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"OTLP traces certificate {settings.certificate_file!r}: {exc}") from None


def exporter_for(settings: OtlpSettings, resource: dict) -> OtlpExporter:
    """The exporter ``settings`` ask for; ConfigError where ``check_usable`` says it cannot be made."""
    check_usable(settings)
    try:
        if settings.protocol == "grpc":
            from telemetry.otlp_grpc import GrpcSender

            sender: Sender = GrpcSender(settings)
        else:
            sender = HttpSender(settings)
    except OSError as exc:  # a CA file that is not PEM (ssl.SSLError)
        raise ConfigError(f"OTLP traces certificate {settings.certificate_file!r}: {exc}") from None
    return OtlpExporter(sender, resource, settings.delay_s, timeout_s=settings.timeout_s)
