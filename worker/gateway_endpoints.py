"""Which gateways a worker serves: ``gateway_address`` as a list of endpoints, host names resolved.

``tcp://gw-a:8001,tcp://gw-b:8001`` names two gateways; a host name stands for every address it
resolves to, so one name serves a whole replica set: a Kubernetes headless Service (``clusterIP:
None``: one A record per ready pod) or a compose service scaled with ``--scale gateway=N``. IPv4
addresses are taken when a name has any (a gateway binds one interface; ``localhost`` also answers
``::1``), else its IPv6 ones. A name that does not resolve now stands for no gateway until it does.
``ipc://`` and ``inproc://`` endpoints are taken as they are.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_gateway_addresses(spec: str) -> list[str]:
    """The comma-separated endpoints of ``spec``; ValueError naming a bad one."""
    endpoints = [part.strip() for part in spec.split(",") if part.strip()]
    if not endpoints:
        raise ValueError("gateway_address names no gateway")
    for endpoint in endpoints:
        if not endpoint.startswith(SCHEMES):
            raise ValueError(f"gateway address {endpoint[:100]!r} is not tcp://host:port, ipc:// or inproc://")
        if endpoint.startswith("tcp://") and not _split(endpoint)[1].isdigit():
            raise ValueError(f"gateway address {endpoint[:100]!r} has no port")
    return endpoints


def _split(endpoint: str) -> tuple[str, str]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def is_literal(endpoint: str) -> bool:
    """Nothing to resolve: an IP address or a non-TCP endpoint."""
    if not endpoint.startswith("tcp://"):
        return True
    try:
        ipaddress.ip_address(_split(endpoint)[0])
        return True
    except ValueError:
        return False


def resolve(endpoint: str) -> list[str]:
    """The endpoints ``endpoint`` stands for now (see the module docstring); [] when it does not resolve."""
    if is_literal(endpoint):
        return [endpoint]
    host, port = _split(endpoint)
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        log.info("gateway name %s does not resolve now: %s", host, exc)
        return []
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    return [f"tcp://{ip}:{port}" for ip in v4] or [f"tcp://[{ip}]:{port}" for ip in v6]


def resolve_all(endpoints: list[str]) -> list[str]:
    """Every endpoint the list stands for now, in order, each once."""
    return list(dict.fromkeys(address for endpoint in endpoints for address in resolve(endpoint)))


class Resolver:
    """Looks the names up again every ``interval_s`` on a daemon thread, so a slow DNS server never
    stalls a worker's loop; ``latest()`` is the newest answer (None until one is new)."""

    def __init__(
        self, endpoints: list[str], interval_s: float, lookup: Callable[[list[str]], list[str]] = resolve_all
    ) -> None:
        self._endpoints, self._interval_s, self._lookup = endpoints, interval_s, lookup
        self._latest: list[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-resolver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._latest = self._lookup(self._endpoints)  # one assignment: atomic for the reader

    def latest(self) -> list[str] | None:
        latest, self._latest = self._latest, None
        return latest

    def close(self) -> None:
        self._stop.set()
