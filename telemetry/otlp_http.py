"""OTLP/HTTP: the encoded request POSTed as application/x-protobuf, optionally gzipped, over TLS when asked."""

from __future__ import annotations

import gzip
import ssl
import urllib.error
import urllib.request

from telemetry.otlp_sender import ExportFailed
from telemetry.otlp_settings import OtlpSettings


class HttpSender:
    """OTLP/HTTP: POST the request to the endpoint URL as application/x-protobuf."""

    def __init__(self, settings: OtlpSettings):
        self.target = settings.endpoint
        self._headers = {"Content-Type": "application/x-protobuf", **dict(settings.headers)}
        self._gzip = settings.compression == "gzip"
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._ssl = ssl.create_default_context(cafile=settings.certificate_file or None) if settings.tls else None

    def send(self, body: bytes, timeout_s: float) -> None:
        data = gzip.compress(body) if self._gzip else body
        request = urllib.request.Request(self.target, data=data, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=self._ssl) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:  # HTTPError (a 4xx/5xx) is a URLError
            raise ExportFailed(str(exc)) from exc

    def close(self) -> None:
        pass
