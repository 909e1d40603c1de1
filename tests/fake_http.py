"""A real HTTP server on loopback that answers every GET from a function: for tests of the HTTP clients
(``pdserve status``, ``pdserve serve``'s readiness wait) against a gateway's answers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def http_get_server(answer: Callable[[str, Message], bytes]) -> Iterator[str]:
    """Yields the server's URL; ``answer(path, headers)`` gives each GET's 200 body."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = answer(self.path, self.headers)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
