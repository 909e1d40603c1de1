"""Observability every process shares, torch-free: log formats (``logs``), request traces (``tracing``,
exported as OTLP/HTTP protobuf by ``otlp``)."""
