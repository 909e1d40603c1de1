"""worker/gateway_links.py: a worker serves several gateways over one DEALER each, answers each request
on the gateway that sent it, and names a gateway lost once it stops acking (or restarts)."""

from __future__ import annotations

import time

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.serving import AbortRequest, Busy, Goodbye, HeartbeatAck
from protocol.zmq_util import bind, make_socket
from worker.gateway_endpoints import parse_gateway_addresses, resolve_all
from worker.gateway_links import GatewayLinks, loss_timeout_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def receive(router: zmq.Socket, timeout_ms: int = 5000):
    assert router.poll(timeout_ms), "nothing arrived"
    identity, frame = router.recv_multipart()
    assert identity == b"w1"
    return decode(frame)


def wait_for(links: GatewayLinks, predicate, what: str) -> None:
    """Polls the links (acks are taken there) until ``predicate`` holds."""
    give_up = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < give_up, what
        time.sleep(0.01)
        links.poll()


@pytest.fixture
def two_gateways():
    ctx = zmq.Context()
    routers = [make_socket(ctx, zmq.ROUTER) for _ in range(2)]
    addresses = [bind(r, "127.0.0.1", 0) for r in routers]
    clock = Clock()
    links = GatewayLinks(ctx, ",".join(addresses), "w1", timeout_s=3.0, resolve_interval_s=1.0, clock=clock)
    links.broadcast(Goodbye("w1"))  # any record (a heartbeat in the product): every gateway gets it
    assert [receive(r) for r in routers] == [Goodbye("w1")] * 2
    yield ctx, routers, links, clock
    links.close()
    ctx.destroy(linger=0)


def test_each_request_answered_on_its_gateway_and_a_silent_one_lost(two_gateways):
    ctx, (a, b), links, clock = two_gateways
    a.send_multipart([b"w1", encode(HeartbeatAck("gw-a"))])
    b.send_multipart([b"w1", encode(HeartbeatAck("gw-b"))])
    wait_for(links, lambda: sorted(links.gateway_ids()) == ["gw-a", "gw-b"], "both acks")
    assert links.send("gw-b", Busy("r1", "full"))
    assert receive(b) == Busy("r1", "full") and not a.poll(200)
    a.send_multipart([b"w1", encode(AbortRequest("r2"))])
    received = []
    give_up = time.monotonic() + 10
    while not received and time.monotonic() < give_up:
        received += links.poll()
    assert received == [AbortRequest("r2")]
    assert links.lost() == []
    clock.now += 2.0
    b.send_multipart([b"w1", encode(HeartbeatAck("gw-b"))])  # b still acks; a went quiet
    wait_for(links, lambda: links._links[b.getsockopt_string(zmq.LAST_ENDPOINT)].last_ack_at == clock.now, "b's ack")
    clock.now += 1.5
    assert links.lost() == ["gw-a"] and links.lost() == []  # named once
    assert links.gateway_ids() == ["gw-b"]


def test_a_restarted_gateway_is_lost_and_used_again(two_gateways):
    ctx, (a, _), links, clock = two_gateways
    a.send_multipart([b"w1", encode(HeartbeatAck("gw-a"))])
    wait_for(links, lambda: links.gateway_ids() == ["gw-a"], "the first ack")
    a.send_multipart([b"w1", encode(HeartbeatAck("gw-a2"))])  # same address, a new process
    wait_for(links, lambda: links.gateway_ids() == ["gw-a2"], "the new id")
    assert links.lost() == ["gw-a"]
    assert links.send("gw-a2", Busy("r", "x")) and receive(a) == Busy("r", "x")


def test_an_unknown_gateway_id_goes_to_links_not_acked_yet(two_gateways):
    ctx, (a, b), links, clock = two_gateways
    a.send_multipart([b"w1", encode(HeartbeatAck("gw-a"))])
    wait_for(links, lambda: links.gateway_ids() == ["gw-a"], "a's ack")
    assert links.send("", Busy("r", "x"))  # a test's gateway that never acks: b has not
    assert receive(b) == Busy("r", "x") and not a.poll(200)


def test_addresses_parsed_and_names_resolved():
    assert parse_gateway_addresses(" tcp://10.0.0.1:8001, tcp://gw:8001 ") == ["tcp://10.0.0.1:8001", "tcp://gw:8001"]
    for bad in ["", "gw:8001", "tcp://gw"]:
        with pytest.raises(ValueError):
            parse_gateway_addresses(bad)
    # localhost answers 127.0.0.1 (and maybe ::1): the IPv4 address is taken; literals stay as they are
    assert resolve_all(["tcp://localhost:8001", "tcp://127.0.0.1:8001", "ipc:///tmp/gw"]) == [
        "tcp://127.0.0.1:8001",
        "ipc:///tmp/gw",
    ]
    assert resolve_all(["tcp://no-such-host.invalid:8001"]) == []


def test_a_name_stands_for_every_gateway_it_resolves_to_as_they_come_and_go():
    ctx = zmq.Context()
    routers = [make_socket(ctx, zmq.ROUTER) for _ in range(2)]
    a, b = [bind(r, "127.0.0.1", 0) for r in routers]
    answers = {"tcp://gateways.test:8001": [a]}  # what the DNS says now; the test changes it

    def lookup(endpoints: list[str]) -> list[str]:
        return [address for endpoint in endpoints for address in answers[endpoint]]

    clock = Clock()
    links = GatewayLinks(
        ctx, "tcp://gateways.test:8001", "w1", timeout_s=3.0, resolve_interval_s=0.05, clock=clock, lookup=lookup
    )
    try:
        assert links.addresses == [a]
        answers["tcp://gateways.test:8001"] = [a, b]  # a second replica scaled up
        wait_for(links, lambda: links.lost() == [] and links.addresses == [a, b], "the new replica's link")
        links.broadcast(Goodbye("w1"))
        assert receive(routers[0]) == receive(routers[1]) == Goodbye("w1")
        routers[0].send_multipart([b"w1", encode(HeartbeatAck("gw-a"))])
        wait_for(links, lambda: links.gateway_ids() == ["gw-a"], "a's ack")
        answers["tcp://gateways.test:8001"] = [b]  # a leaves the name's answers (draining); b never acked
        time.sleep(0.2)
        assert links.lost() == [] and links.addresses == [a, b]  # a still acks: its streams go on
        clock.now += 3.5
        assert links.lost() == ["gw-a"] and links.addresses == [b]  # silent and gone from DNS: closed
    finally:
        links.close()
        ctx.destroy(linger=0)


def test_a_gateway_is_lost_only_after_two_heartbeats_without_an_ack_at_least():
    assert loss_timeout_s(15.0, 5.0) == 15.0  # the configured horizon, as the gateway drops workers
    assert loss_timeout_s(3.0, 5.0) == 10.0  # acks come once per heartbeat: never under two of them
    assert loss_timeout_s(0.0, 1.0) == 15.0  # 0: the default
