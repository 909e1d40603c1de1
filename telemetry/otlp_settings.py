"""Where and how a process exports its traces: the OpenTelemetry exporter variables, read as the OTel
SDKs read them (opentelemetry.io/docs/specs/otel/protocol/exporter), for the one signal pdserve exports.

Each setting is ``OTEL_EXPORTER_OTLP_TRACES_<X>``, else ``OTEL_EXPORTER_OTLP_<X>``:

    ENDPOINT     --otlp-traces-endpoint wins; the generic variable is a base URL: http/protobuf appends
                 /v1/traces to it, gRPC takes it as it is (http://collector:4317)
    PROTOCOL     http/protobuf (default) | grpc
    HEADERS      key=value,key2=value2, values percent-encoded (an Authorization for a hosted collector);
                 HTTP headers, or gRPC metadata (keys lower-cased, as gRPC requires)
    TIMEOUT      ms one export may take (default 10000)
    COMPRESSION  none (default) | gzip: of each export's body (HTTP Content-Encoding, or gRPC's own)
    CERTIFICATE  PEM file of the CA that signs the collector's certificate (https); default: system roots
    INSECURE     gRPC to an endpoint without a scheme: true = plaintext (default false = TLS); an http://
                 or https:// endpoint says which itself

An unknown protocol or an endpoint the protocol cannot use is a ConfigError: the process stops at start
with one line, rather than running with tracing silently off.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from dataclasses import dataclass

from configs.schema import ConfigError

log = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
COMPRESSIONS = ("none", "gzip")


@dataclass(frozen=True, slots=True)
class OtlpSettings:
    endpoint: str  # http/protobuf: the URL posted to; grpc: [scheme://]host:port (a path is ignored)
    protocol: str  # one of PROTOCOLS
    headers: tuple[tuple[str, str], ...]  # sent with every export
    timeout_s: float  # one export, connection included
    delay_s: float  # between batches (OTEL_BSP_SCHEDULE_DELAY)
    certificate_file: str  # "" = the system's CA roots
    tls: bool  # grpc: a TLS channel (https://, or no scheme and not INSECURE); http: the URL's scheme
    compression: str = "none"  # one of COMPRESSIONS

    def __post_init__(self) -> None:
        assert self.protocol in PROTOCOLS and self.compression in COMPRESSIONS
        assert self.timeout_s > 0 and self.delay_s > 0


def otlp_settings(endpoint: str, env=os.environ) -> OtlpSettings | None:
    """The settings for ``endpoint`` (the config's; "" = the environment's), or None: tracing is off."""

    def setting(name: str, default: str = "") -> str:
        return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or default

    protocol = setting("PROTOCOL", "http/protobuf").strip().lower()
    endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        endpoint = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"
    if not endpoint:
        return None  # a protocol without an endpoint (a shared environment's) is no reason to stop
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported; use one of {PROTOCOLS}")
    scheme = urllib.parse.urlsplit(endpoint).scheme if "://" in endpoint else ""
    if scheme not in ("", "http", "https") or (protocol == "http/protobuf" and not scheme):
        raise ConfigError(
            f"OTLP traces endpoint {endpoint!r} ({protocol}) needs an http:// or https:// URL, "
            "e.g. http://collector:4318/v1/traces (http/protobuf) or http://collector:4317 (grpc)"
        )
    insecure = setting("INSECURE", "false").strip().lower() == "true"
    compression = setting("COMPRESSION", "none").strip().lower()
    if compression not in COMPRESSIONS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION={compression!r} is not supported; use one of {COMPRESSIONS}"
        )
    return OtlpSettings(
        endpoint,
        protocol,
        headers(setting("HEADERS")),
        _seconds("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", setting("TIMEOUT", "10000"), 10.0),
        _seconds("OTEL_BSP_SCHEDULE_DELAY", env.get("OTEL_BSP_SCHEDULE_DELAY", "1000"), 1.0),
        setting("CERTIFICATE"),
        scheme == "https" or (scheme == "" and not insecure),
        compression,
    )


def headers(text: str) -> tuple[tuple[str, str], ...]:
    """OTEL's ``key=value,key2=value2`` (W3C baggage syntax: values percent-encoded); malformed
    entries are skipped, as the SDKs do."""
    pairs = (part.split("=", 1) for part in text.split(",") if "=" in part)
    return tuple((k.strip(), urllib.parse.unquote(v.strip())) for k, v in pairs if k.strip())


def _seconds(name: str, text: str, default_s: float) -> float:
    """A variable in milliseconds, in seconds (at least 10 ms); not a number: a warning and the default."""
    try:
        value = float(text) / 1000
    except ValueError:
        value = -1.0
    if not value >= 0:  # negative or NaN
        log.warning("%s=%r is not a positive number of milliseconds; using %g", name, text, default_s * 1000)
        return default_s
    return max(value, 0.01)
