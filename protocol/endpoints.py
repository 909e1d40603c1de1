"""Endpoints a peer tells us to connect to (a worker's address in a Heartbeat, a PrefillJob's
kv_address): checked before any socket sees them, since ZeroMQ raises on a malformed one."""

from __future__ import annotations

import re

MAX_ENDPOINT_CHARS = 300
# tcp://<IPv4 | [IPv6] | DNS name>:<port>; what bind() in protocol/zmq_util.py reports for a bound socket.
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):(\d{1,5})$")


def endpoint_error(address: str) -> str:
    """ "" when ``address`` is a connectable tcp endpoint, else why not (quoting at most 80 characters)."""
    if len(address) > MAX_ENDPOINT_CHARS:
        return f"endpoint of {len(address)} characters"
    match = _TCP.match(address)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        return f"not a tcp://host:port endpoint: {address[:80]!r}"
    return ""
