"""A worker's links to every gateway in front of its pool: one DEALER (``WorkerSocket``) per gateway.

Several gateways can share one pool of workers (docs/gateway-replicas.md): each worker registers with
each of them, so every gateway sees every worker and its load. The addresses come from
``gateway_address`` (worker/gateway_endpoints.py): a list, and host names that stand for every address
they resolve to, looked up again every heartbeat interval.

Life of one link:
1. its address appears (configured, or newly resolved): a DEALER connects; heartbeats go to every link
2. the gateway acks each heartbeat with its id: the link learns whose it is. A request names the
   gateway it came from (``Generate.gateway_id``), and its events go back over the link with that id
3. no ack for ``timeout_s``, or an ack with another id (the gateway restarted): that gateway is lost.
   ``lost()`` names it once, and the worker aborts its requests (their blocks are freed) and goes on
   heartbeating, so a gateway that comes back registers the worker again and is used again. A link
   whose connection dropped is made anew (what was queued for the dead gateway is dropped with it); a
   silent one keeps its connection: a gateway that was only stalled (SIGSTOP, a long pause) reads the
   queued heartbeats when it wakes and registers the worker again on it. A fresh socket there would
   reuse the worker's routing id, which the gateway's ROUTER (no handover) refuses while it still holds
   the old connection, so the worker would never be heard again (the chaos tool's gateway SIGSTOP)
4. an address that no longer resolves is closed once its link is not acked (lost, or never was);
   one still acked keeps serving its streams (a gateway draining out of a Service's endpoints)

Two threads use the links: the worker's loop, and its heartbeat thread (worker/liveness.py), which
sends while the loop is inside a long step. A ZeroMQ socket is not thread-safe, so every use of a link's
sockets, the loop's wait on them included (``locked``), holds one lock; the loop holds it only briefly
(never during an engine step), so a heartbeat waits at most one idle poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from protocol.curve import PlaneSecurity
from worker.gateway_endpoints import Resolver, is_literal, parse_gateway_addresses, resolve_all
from worker.gateway_socket import GATEWAY_RECORDS, WorkerSocket

log = logging.getLogger(__name__)


def loss_timeout_s(worker_timeout_s: float, heartbeat_s: float) -> float:
    """How long a gateway may ack nothing before it is lost: ``gateway.worker_timeout_s`` (the horizon
    after which a gateway drops a silent worker; 0: 15 s), but never under two heartbeats, since acks
    come once per heartbeat and a shorter horizon would take a live gateway for dead."""
    return max(worker_timeout_s or 15.0, 2 * heartbeat_s)


class GatewayLinks:
    def __init__(
        self,
        ctx: zmq.Context,
        gateway_address: str,
        worker_id: str,
        *,
        timeout_s: float,
        resolve_interval_s: float,
        accepted: tuple[type, ...] = GATEWAY_RECORDS,
        clock: Callable[[], float] = time.monotonic,
        lookup: Callable[[list[str]], list[str]] = resolve_all,
        security: PlaneSecurity | None = None,
    ) -> None:
        assert timeout_s > 0 and resolve_interval_s > 0
        self._ctx, self._worker_id, self._accepted, self._clock = ctx, worker_id, accepted, clock
        self.security = security or PlaneSecurity(None)  # one client keypair for every link: one proof
        self.timeout_s = timeout_s
        self._lock = threading.RLock()  # every use of the links' sockets (see the module docstring)
        endpoints = parse_gateway_addresses(gateway_address)
        self._links: dict[str, WorkerSocket] = {}  # address -> link
        self._wanted: set[str] = set()  # the addresses the configuration stands for now
        self._apply(lookup(endpoints))
        names = [e for e in endpoints if not is_literal(e)]
        self._resolver = Resolver(endpoints, resolve_interval_s, lookup) if names else None

    # ---- the set of links ----
    def _apply(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self._links:
                log.info("connecting to gateway %s", address)
                self._links[address] = WorkerSocket(
                    self._ctx,
                    address,
                    self._worker_id,
                    accepted=self._accepted,
                    clock=self._clock,
                    security=self.security,
                )
        for address in [a for a, link in self._links.items() if a not in addresses and not link.gateway_id]:
            log.info("gateway %s no longer resolves: link closed", address)
            self._links.pop(address).close()
        self._wanted = set(addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self._links)

    @contextmanager
    def locked(self) -> Iterator[list[zmq.Socket]]:
        """The links' sockets, for the loop to wait on, held from the heartbeat thread meanwhile."""
        with self._lock:
            yield [link.sock for link in self._links.values()]

    def gateway_ids(self) -> list[str]:
        """Ids of the gateways that ack this worker now."""
        return [link.gateway_id for link in self._links.values() if link.gateway_id]

    # ---- traffic ----
    def poll(self) -> list:
        """What every gateway sent since the last call (acks are taken by the links)."""
        with self._lock:
            return [record for link in list(self._links.values()) for record in link.poll()]

    def poll_from(self) -> list[tuple[str, object]]:
        """What every gateway sent, each record with the id its link's gateway acked ("" before one)."""
        with self._lock:
            return [(link.gateway_id, record) for link in list(self._links.values()) for record in link.poll()]

    def may_abort(self, sender: str, owner: str) -> bool:
        """Whether the gateway acked as ``sender`` may abort a request ``owner`` sent: only the owner, once
        a link has acked it; a request from a gateway no link acked (a test's) is any link's to abort."""
        return sender == owner or owner not in self.gateway_ids()

    def send(self, gateway_id: str, record) -> bool:
        """To the gateway with ``gateway_id``. An id no link has acked (yet, or ever: a test's gateway)
        goes to every link not acked yet; a gateway drops records of requests it does not know."""
        with self._lock:
            for link in self._links.values():
                if link.gateway_id and link.gateway_id == gateway_id:
                    return link.send(record)
            unacked = [link for link in self._links.values() if not link.gateway_id]
            return any([link.send(record) for link in unacked])

    def registration_proof(self, incarnation: str, role: str) -> str:
        """What the Heartbeat's ``proof`` carries (protocol/curve.py): the same over every link."""
        return self.security.registration_proof(self._worker_id, incarnation, role)

    def broadcast(self, record) -> None:
        """To every gateway: heartbeats, goodbye."""
        with self._lock:
            for link in self._links.values():
                link.send(record)

    # ---- loss ----
    def lost(self) -> list[str]:
        """Ids of the gateways lost since the last call (silent past the timeout, or restarted); their
        requests are the caller's to abort. Also takes the resolver's newest answer."""
        with self._lock:
            return self._lost()

    def _lost(self) -> list[str]:
        if self._resolver is not None and (latest := self._resolver.latest()) is not None:
            self._apply(latest)
        now = self._clock()
        lost = []
        for address, link in list(self._links.items()):
            lost += link.replaced_ids
            link.replaced_ids.clear()
            disconnected = link.take_lost()  # closed, or its ZMTP heartbeats stopped
            if link.gateway_id and (disconnected or now - link.last_ack_at > self.timeout_s):
                log.warning(
                    "gateway %s at %s %s: its requests are aborted",
                    link.gateway_id,
                    address,
                    "disconnected" if disconnected else f"silent for {now - link.last_ack_at:.1f} s",
                )
                lost.append(link.gateway_id)
                if disconnected:
                    link.reset()
                else:  # a stalled gateway (paused, swapping): keep the connection, wait for an ack again
                    link.forget_ack()
                if address not in self._wanted:
                    self._links.pop(address).close()
        return lost

    @property
    def num_rejected(self) -> int:
        return sum(link.num_rejected for link in list(self._links.values()))

    def close(self) -> None:
        if self._resolver is not None:
            self._resolver.close()
        with self._lock:
            for link in self._links.values():
                link.close()
