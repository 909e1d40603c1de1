"""``X-Request-Id``, as vLLM reads it: a client's id for its request.

A completion's or chat completion's ``id`` is then ``cmpl-<it>`` / ``chatcmpl-<it>``, and the id the
workers log the request under starts with that, so one grep follows it from client to prefill worker.
Every answer to a request that carried one, errors included, carries it back in the same header. Ids
are the client's to keep unique; the workers' ids add a nonce of their own, so a reused one never mixes
two requests' tokens. A Responses API answer keeps a server-made ``resp_`` id: the store is keyed by it.
An id longer than ``MAX_CHARS`` or with characters other than visible ASCII is a 400.
"""

from __future__ import annotations

import re

from .errors import bad_request

HEADER = "x-request-id"
MAX_CHARS = 128
_VALID = re.compile(rb"[!-~]{1,%d}" % MAX_CHARS)  # visible ASCII: safe in ids, logs and headers


class RequestIdEcho:
    """ASGI middleware: the request's X-Request-Id goes back on its answer (an unusable one: a 400)."""

    def __init__(self, app, error_response) -> None:
        self.app = app
        self._error_response = error_response

    async def __call__(self, scope, receive, send) -> None:
        given = dict(scope["headers"]).get(HEADER.encode()) if scope["type"] == "http" else None
        if given is None:
            await self.app(scope, receive, send)
            return
        if not _VALID.fullmatch(given):  # serving then takes the header as it is
            refusal = bad_request(f"X-Request-Id must be 1 to {MAX_CHARS} visible ASCII characters", "X-Request-Id")
            await self._error_response(refusal)(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
