"""The OTLP protobuf encoding of finished spans, hand-written: the message schema we fill is small
(opentelemetry/proto/collector/trace/v1 ExportTraceServiceRequest and what it nests), and this keeps
the OpenTelemetry SDK and protobuf runtime out of the gateway and the workers. OTLP/HTTP posts these
bytes and OTLP/gRPC sends them as TraceService/Export's request (``otlp_export``, ``otlp_grpc``).

    ExportTraceServiceRequest { 1: repeated ResourceSpans }
    ResourceSpans             { 1: Resource { 1: repeated KeyValue }   2: repeated ScopeSpans }
    ScopeSpans                { 1: InstrumentationScope { 1: name, 2: version }   2: repeated Span }
    Span  { 1: trace_id (16 bytes)  2: span_id (8)  4: parent_span_id  5: name  6: kind (enum)
            7: start_time_unix_nano (fixed64)  8: end_time_unix_nano (fixed64)  9: repeated KeyValue
            15: Status { 2: message  3: code (enum: 2 = ERROR) } }
    KeyValue { 1: key  2: AnyValue { 1: string | 2: bool | 3: int64 | 4: double } }
"""

from __future__ import annotations

import struct

from telemetry.span import Span

SCOPE_NAME = "pdserve"
STATUS_CODE_ERROR = 2
_U64 = (1 << 64) - 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value & _U64)


def _fixed64_field(number: int, value: int) -> bytes:
    return _varint(number << 3 | 1) + struct.pack("<Q", value & _U64)


def _any_value(value) -> bytes:
    if isinstance(value, bool):
        return _varint_field(2, int(value))
    if isinstance(value, int):
        return _varint_field(3, value)  # int64: negatives as two's complement, ten bytes
    if isinstance(value, float):
        return _varint(4 << 3 | 1) + struct.pack("<d", value)
    return _bytes_field(1, str(value).encode())


def _attributes(number: int, attributes: dict) -> bytes:
    return b"".join(
        _bytes_field(number, _bytes_field(1, k.encode()) + _bytes_field(2, _any_value(v)))
        for k, v in attributes.items()
    )


def encode_span(span: Span) -> bytes:
    out = [_bytes_field(1, span.trace_id), _bytes_field(2, span.span_id)]
    if span.parent_span_id:
        out.append(_bytes_field(4, span.parent_span_id))
    out += [
        _bytes_field(5, span.name.encode()),
        _varint_field(6, span.kind),
        _fixed64_field(7, span.start_ns),
        _fixed64_field(8, span.end_ns),
        _attributes(9, span.attributes),
    ]
    if span.error is not None:
        out.append(_bytes_field(15, _bytes_field(2, span.error.encode()) + _varint_field(3, STATUS_CODE_ERROR)))
    return b"".join(out)


def encode_request(resource: dict, spans: list[Span]) -> bytes:
    """One ExportTraceServiceRequest: this process's resource, one scope, ``spans``."""
    scope = _bytes_field(1, SCOPE_NAME.encode())
    scope_spans = _bytes_field(1, scope) + b"".join(_bytes_field(2, encode_span(s)) for s in spans)
    resource_spans = _bytes_field(1, _attributes(1, resource)) + _bytes_field(2, scope_spans)
    return _bytes_field(1, resource_spans)
