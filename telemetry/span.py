"""A finished span's record and the W3C trace context that links spans across processes.

    traceparent: "00-<trace id, 32 hex>-<parent span id, 16 hex>-<flags, 2 hex>"   (www.w3.org/TR/trace-context)

The gateway takes it from the client's ``traceparent`` header (or starts a trace), and hands its own
request span's on in ``Generate.traceparent``; the decode worker hands its own on in
``PrefillJob.traceparent``: one trace per request, across the three processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# OTLP's Span.SpanKind
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(slots=True)
class Span:
    name: str
    trace_id: bytes  # 16 bytes, shared by every span of the request
    span_id: bytes  # 8 bytes
    parent_span_id: bytes  # 8 bytes; b"" for a trace's root
    start_ns: int  # time.time_ns(): spans from several hosts share one clock domain (wall time)
    end_ns: int = 0
    kind: int = KIND_INTERNAL
    attributes: dict = field(default_factory=dict)  # str -> str | bool | int | float
    error: str | None = None  # set: the span's status is ERROR with this message

    def __post_init__(self) -> None:
        assert len(self.trace_id) == 16 and len(self.span_id) == 8 and len(self.parent_span_id) in (0, 8)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id.hex()}-{self.span_id.hex()}-01"


def parse_traceparent(text: str) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) from a traceparent; None when it is malformed or all zeros, which
    W3C says to ignore (a new trace starts) rather than refuse."""
    match = _TRACEPARENT.fullmatch(text.strip().lower()) if text and len(text) <= 64 else None
    if match is None or match.group(1) == "ff":
        return None
    trace_id, span_id = bytes.fromhex(match.group(2)), bytes.fromhex(match.group(3))
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id
