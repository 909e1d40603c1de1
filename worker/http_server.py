"""/metrics, /health and /ready on a stdlib HTTP server in a daemon thread.

/health answers 200 while the process runs (liveness); /ready answers 200 only while ``is_ready()``
(loaded, connected, not draining), else 503, so an orchestrator stops sending it work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


@dataclass(slots=True)
class HttpHandle:
    server: ThreadingHTTPServer
    thread: threading.Thread
    port: int  # the port actually bound (the config may ask for 0: any free port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_http(host: str, port: int, registry: CollectorRegistry, is_ready: Callable[[], bool]) -> HttpHandle:
    if host in ("", "0.0.0.0", "::", "*"):
        raise ValueError(f"refusing to bind all interfaces ({host!r}); name one, e.g. 127.0.0.1")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._reply(200, b"ok\n")
            elif path == "/ready":
                ready = is_ready()
                self._reply(200 if ready else 503, b"ready\n" if ready else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # scrapes every few seconds: keep logs quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="worker-http", daemon=True)
    thread.start()
    return HttpHandle(server, thread, server.server_address[1])
