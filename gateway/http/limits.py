"""Time limits on HTTP connections, so slow or stalled clients cannot hold the gateway's sockets and
requests (uvicorn has a keep-alive timeout only, reset by every byte a client sends).

A connection moves through:

    headers   from accept, or the end of the previous response: the request line and headers must all
              arrive within ``header_timeout_s`` (a slowloris client sending a byte at a time is cut off)
    body      from the end of the headers: the whole body within ``body_timeout_s``
    response  the app runs; no read limit (a request may wait minutes for its tokens). A client that
              stops reading: once uvicorn's write buffer is full the transport pauses writing, and a
              pause longer than ``write_timeout_s`` drops the client; the app sees ``http.disconnect``
              and aborts its backend requests, so the workers free its blocks.

A connection past a limit is aborted (nothing buffered is flushed: a stalled client must not pin a
socket either). A connection opened while ``max_connections`` are open gets OpenAI's error JSON, 503 with
Retry-After, to its request, and is closed. ``TimedH11Protocol`` is uvicorn's own h11 protocol with these
timers; gateway/__main__.py passes it.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import no_capacity

log = logging.getLogger("pdserve.gateway")


@dataclass(slots=True, frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # gateway.http_header_timeout_s
    body_timeout_s: float = 30.0  # gateway.http_body_timeout_s
    write_timeout_s: float = 30.0  # gateway.http_write_timeout_s
    max_connections: int | None = 1024  # gateway.max_connections; None: no limit


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines per request and a write-stall limit (module docstring)."""

    def __init__(self, *args, limits: HttpLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._reading: str | None = None  # "headers" | "body" while a read deadline runs
        self._read_timer = None
        self._write_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limit = self._limits.max_connections
        if limit is not None and len(self.connections) > limit:  # this one is counted already
            self.app = _refusal(limit)  # its request (after its headers, read as any) gets the 503
        self._arm_read("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._reading = None
            self._follow_request()  # the next request's headers (or a pipelined one already here)

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._reading is None:
                self._arm_read("headers")
        elif state is h11.SEND_BODY:
            if self._reading != "body":
                self._arm_read("body")
        else:  # the whole request is in (or the connection is ending): no read deadline while the app runs
            self._cancel_read()

    def _arm_read(self, what: str) -> None:
        self._cancel_read()
        self._reading = what
        timeout = self._limits.header_timeout_s if what == "headers" else self._limits.body_timeout_s
        self._read_timer = self.loop.call_later(
            timeout, self._drop, f"request {what} not received within {timeout:g} s"
        )

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._reading = None, None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            timeout = self._limits.write_timeout_s
            self._write_timer = self.loop.call_later(timeout, self._drop, f"client read nothing for {timeout:g} s")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc) -> None:
        self._cancel_read()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def _drop(self, why: str) -> None:
        self._read_timer = self._write_timer = None
        if not self.transport.is_closing() or self.flow.write_paused:
            log.info("dropping HTTP client %s: %s", _address(self.client), why)
            self.transport.abort()


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def _refusal(limit: int):
    """An ASGI app answering 503 in OpenAI's error shape, and closing the connection."""
    error = no_capacity(1, f"this server has {limit} connections open, its limit (gateway.max_connections)")
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def refuse(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def uvicorn_options(limits: HttpLimits) -> dict:
    """uvicorn.Config / uvicorn.run keyword arguments that apply ``limits``."""
    return {"http": functools.partial(TimedH11Protocol, limits=limits)}
