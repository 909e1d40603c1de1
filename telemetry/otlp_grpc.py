"""OTLP/gRPC: the encoded ExportTraceServiceRequest sent as TraceService/Export's request, over one
long-lived channel. A generic unary call with raw bytes (no serializer on either side), so no
generated stubs or protobuf runtime: grpcio alone (the ``otlp-grpc`` extra).

The endpoint is ``[scheme://]host:port`` (OTel: http:// = plaintext, https:// = TLS, no scheme = TLS
unless OTEL_EXPORTER_OTLP_TRACES_INSECURE=true); a path, if any, is ignored, as the OTel SDKs do.
"""

from __future__ import annotations

import urllib.parse

import grpc

from telemetry.otlp_sender import ExportFailed
from telemetry.otlp_settings import OtlpSettings

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def grpc_target(endpoint: str) -> str:
    """host:port of ``endpoint``, with or without a scheme and a path."""
    return urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").netloc


class GrpcSender:
    def __init__(self, settings: OtlpSettings):
        self.target = grpc_target(settings.endpoint)
        if settings.tls:
            roots = None
            if settings.certificate_file:
                with open(settings.certificate_file, "rb") as f:
                    roots = f.read()
            self._channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(roots))
        else:
            self._channel = grpc.insecure_channel(self.target)
        self._export = self._channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        self._metadata = tuple((key.lower(), value) for key, value in settings.headers)
        self._compression = grpc.Compression.Gzip if settings.compression == "gzip" else grpc.Compression.NoCompression

    def send(self, body: bytes, timeout_s: float) -> None:
        try:
            self._export(body, timeout=timeout_s, metadata=self._metadata, compression=self._compression)
        except grpc.RpcError as exc:  # UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED ...
            raise ExportFailed(f"{exc.code().name}: {exc.details()}") from exc

    def close(self) -> None:
        self._channel.close()
