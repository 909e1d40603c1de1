"""Only the owner of a request aborts it (#47): on a prefill worker, an AbortRequest or a replacing
PrefillJob for a job is taken only from the connection (its CURVE key; insecure: its routing id) that
sent the job; from the gateway side, only from the gateway that owns the request (GatewayLinks.may_abort).
A foreign abort is refused (``not_assigned``), the job runs on with exact KV, and nothing leaks."""

from __future__ import annotations

import dataclasses
import time

import zmq

from prefill_node.job import JobPhase
from protocol.codec import encode
from protocol.serving import AbortRequest, Heartbeat, HeartbeatAck
from protocol.zmq_util import bind, make_socket
from tests.test_prefill_node import cluster, expect_kv, prompt, reference  # noqa: F401  (cluster: a fixture)
from worker.gateway_links import GatewayLinks


def test_a_foreign_abort_or_replacement_of_a_prefill_job_is_refused(cluster):  # noqa: F811
    c = cluster
    tokens = prompt(19, seed=7)
    ref_kv, _ = reference(tokens)
    job = c.decode.job("a", tokens)
    c.decode.send(job)
    c.delivered()
    c.turn()
    assert c.server.phase_of("a") is JobPhase.PREFILLING
    intruder = make_socket(c.ctx, zmq.DEALER)  # another peer of the job socket (here: another routing id)
    intruder.connect(c.server.address)
    intruder.send(encode(AbortRequest("a", "not yours")))
    intruder.send(encode(dataclasses.replace(job, token_ids=prompt(19, seed=8))))
    assert c.server.router.poll(2000)
    time.sleep(0.05)
    c.turn()
    assert c.server.rejects.counts["not_assigned"] == 2
    assert c.server.phase_of("a") is not None and c.server.jobs["a"].job.token_ids == tokens
    c.turn(8)
    assert c.decode.wait_event("a").ok
    expect_kv(c, job, ref_kv)  # the KV of the sender's prompt, not the intruder's
    c.decode.adopt("a")
    c.assert_idle_no_leak()
    assert c.sample("pdserve:prefill_jobs_aborted_total") == 0
    intruder.close(linger=0)


def test_a_gateway_aborts_only_its_own_requests():
    ctx = zmq.Context()
    routers = [make_socket(ctx, zmq.ROUTER) for _ in range(2)]
    addresses = [bind(r, "127.0.0.1") for r in routers]
    links = GatewayLinks(ctx, ",".join(addresses), "d0", timeout_s=10, resolve_interval_s=10)
    try:
        links.broadcast(Heartbeat("d0", "decode", "tcp://127.0.0.1:9", "inc", 4, 8, 8, 0, 0, 0, 0))
        for router, gateway_id in zip(routers, ("gw-a", "gw-b")):
            assert router.poll(5000)
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, encode(HeartbeatAck(gateway_id))])
            router.send_multipart([identity, encode(AbortRequest("r1", "client gone"))])
        received: list[tuple[str, object]] = []
        give_up = time.monotonic() + 5
        while len(received) < 2 and time.monotonic() < give_up:
            received += links.poll_from()
            time.sleep(0.01)
        assert sorted(sender for sender, _ in received) == ["gw-a", "gw-b"]
        assert all(isinstance(r, AbortRequest) for _, r in received)
        assert links.may_abort("gw-a", "gw-a") and not links.may_abort("gw-b", "gw-a")
        assert links.may_abort("gw-b", "gw-test")  # a request of a gateway no link acked (a test's)
    finally:
        links.close()
        for r in routers:
            r.close(linger=0)
        ctx.term()
