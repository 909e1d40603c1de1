"""Observability every process shares, torch-free: log formats (``logs``), request traces (``tracing``),
encoded as OTLP protobuf (``otlp``) and exported over HTTP or gRPC (``otlp_settings``, ``otlp_export``,
``otlp_grpc``)."""
