"""/metrics, /health and /ready on a stdlib HTTP server in a daemon thread.

/health answers 200 while the process runs (liveness); /ready answers 200 only while ``is_ready()``
(loaded, connected, not draining), else 503, so an orchestrator stops sending it work.

Slow clients cannot hold it: at most ``max_connections`` are served at once (one thread each; more are
closed at once, and a scraper retries), and a watchdog shuts every connection down
``connection_deadline_s`` after accept, whatever it is doing (a slowloris client sending a byte at a
time resets a socket timeout, not this deadline). One request per connection (HTTP/1.0).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_CONNECTIONS = 16  # scrapes and probes served at once
CONNECTION_DEADLINE_S = 10.0  # a scrape of the largest registry takes well under a second


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on connections and a deadline on each (module docstring)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int, deadline_s: float) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadline_s = deadline_s
        self._deadlines: dict[socket.socket, float] = {}  # open connection -> when it is shut down
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.num_refused = 0  # connections closed at once for want of a slot
        self.num_expired = 0  # connections shut down at their deadline
        threading.Thread(target=self._expire, name="worker-http-watchdog", daemon=True).start()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.num_refused += 1
            self.shutdown_request(request)
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + self._deadline_s
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request) -> None:
        with self._lock:
            del self._deadlines[request]
        self._slots.release()

    def _expire(self) -> None:
        while not self._closed.wait(min(0.25, self._deadline_s / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [s for s, deadline in self._deadlines.items() if deadline <= now]
                for s in expired:
                    self._deadlines[s] = float("inf")  # shut down once
            for s in expired:
                self.num_expired += 1
                try:
                    s.shutdown(socket.SHUT_RDWR)  # its handler's read or write ends; its thread closes it
                except OSError:
                    pass  # closed meanwhile

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


@dataclass(slots=True)
class HttpHandle:
    server: BoundedHTTPServer
    thread: threading.Thread
    port: int  # the port actually bound (the config may ask for 0: any free port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_http(
    host: str,
    port: int,
    registry: CollectorRegistry,
    is_ready: Callable[[], bool],
    *,
    max_connections: int = MAX_CONNECTIONS,
    connection_deadline_s: float = CONNECTION_DEADLINE_S,
) -> HttpHandle:
    if host in ("", "0.0.0.0", "::", "*"):
        raise ValueError(f"refusing to bind all interfaces ({host!r}); name one, e.g. 127.0.0.1")

    class Handler(BaseHTTPRequestHandler):
        timeout = connection_deadline_s  # each read or write; the watchdog bounds the whole connection

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

    server = BoundedHTTPServer((host, port), Handler, max_connections, connection_deadline_s)
    thread = threading.Thread(target=server.serve_forever, name="worker-http", daemon=True)
    thread.start()
    return HttpHandle(server, thread, server.server_address[1])
