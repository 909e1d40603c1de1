"""Real OTLP trace receivers on a loopback port, for tests: OTLP/HTTP (``OtlpReceiver``) and OTLP/gRPC
(``OtlpGrpcReceiver``, a grpc.server serving TraceService/Export). Both decode each export with the
OpenTelemetry project's own protobuf classes (opentelemetry-proto), independently of our encoder."""

from __future__ import annotations

import gzip
import ssl
import threading
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import trustme
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict
    error: str | None  # the status message when the status is ERROR


class OtlpReceiver:
    def __init__(self, server_cert: trustme.LeafCert | None = None) -> None:
        """``server_cert``: serve HTTPS with it (at https://localhost:<port>)."""
        self.spans: list[ReceivedSpan] = []
        self.content_types: set[str] = set()
        self.headers: list[dict[str, str]] = []  # each POST's
        lock, spans, content_types, headers = threading.Lock(), self.spans, self.content_types, self.headers

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    content_types.add(self.headers["Content-Type"])
                    headers.append(dict(self.headers))
                    spans.extend(_spans_of(request))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        port = self._server.server_address[1]
        if server_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server_cert.configure_cert(context)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://localhost:{port}/v1/traces" if server_cert else f"http://127.0.0.1:{port}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtlpGrpcReceiver:
    """TraceService/Export on a grpc.server with a generic handler (no generated stubs on either side):
    ``headers`` holds each call's metadata, ``url`` is what an OTLP/gRPC exporter is pointed at."""

    def __init__(self, server_cert: trustme.LeafCert | None = None) -> None:
        """``server_cert``: a TLS port with it (at https://localhost:<port>)."""
        self.spans: list[ReceivedSpan] = []
        self.headers: list[dict[str, str]] = []
        lock = threading.Lock()

        def export(request: ExportTraceServiceRequest, context: grpc.ServicerContext) -> ExportTraceServiceResponse:
            with lock:
                self.headers.append(dict(context.invocation_metadata()))
                self.spans.extend(_spans_of(request))
            return ExportTraceServiceResponse()

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    export,
                    request_deserializer=ExportTraceServiceRequest.FromString,
                    response_serializer=ExportTraceServiceResponse.SerializeToString,
                )
            },
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=(handler,))
        if server_cert is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
            self.url = f"http://127.0.0.1:{port}"
        else:
            key, chain = server_cert.private_key_pem.bytes(), b"".join(p.bytes() for p in server_cert.cert_chain_pems)
            port = self._server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)]))
            self.url = f"https://localhost:{port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def _spans_of(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                error = s.status.message if s.status.code == s.status.STATUS_CODE_ERROR else None
                out.append(
                    ReceivedSpan(
                        resource["service.name"],
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {kv.key: _value(kv.value) for kv in s.attributes},
                        error,
                    )
                )
    return out
