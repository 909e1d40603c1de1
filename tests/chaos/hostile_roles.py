"""Attacks by a compromised member of one role, under load (#47): on a ``pdserve serve`` 2 + 2 whose
members hold their own credentials (no key configured: pdserve serve makes a key per member), the
attacker holds what a compromised decode pod holds, decode-0's key file and roles.pub, or a second decode
member's key (tests/hostile_roles.py, the CI suite's own code). Each attack runs through the hostile
runner (tests/chaos/hostile.py ``run_attack``): the steady load meanwhile must come back exact, nothing
may stay held, no worker may die (save the one the squatting attack kills), and the refusals are counted.

A Redis read from a worker's position and a cross-tenant read of a stored response need a Responses
store in Redis: tests/chaos/hostile_store.py runs them on such a cluster."""

from __future__ import annotations

import signal

import httpx

from protocol.codec import encode
from protocol.serving import Goodbye
from tests import hostile
from tests import hostile_attacks as attacks
from tests import hostile_roles as roles
from tests.chaos.clusters import BLOCK
from tests.chaos.hostile import REJECTED, HostileCluster, HostileResult, in_flight_job, kv_address
from tests.netns import poll_until

VALID_FIRST_TOKEN = 5  # inside the vocabulary: the wrong KV would pass the decode worker's check


class RoleCluster(HostileCluster):
    """The hostile runner's cluster with a credential per member instead of one cluster key."""

    def __init__(self, model: str, tmp):
        super().__init__(model, tmp, cluster_key=False)

    def target(self, ctx) -> attacks.Target:
        t = super().target(ctx)
        t.key_file = roles.member_key_file(self.serve.worker_pid["decode-0"])  # what the compromised pod holds
        return t


def _gateway_rejected(cluster: HostileCluster, reason: str) -> float:
    """The gateway's refusals for ``reason`` (0 before the first: a labelled counter appears with it)."""
    body = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    return sum(float(value) for label, value in REJECTED.findall(body) if label == reason)


def decode_posing_as_prefill(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """decode-0's credential registers as a prefill worker that would commit a valid first token over
    wrong KV: refused at registration (bad_proof), never given a job; the load's exact answers show no
    client got its KV."""
    before = _gateway_rejected(cluster, "bad_proof")
    security = roles.posing_as(t.key_file, "prefill")
    fake = hostile.FakePrefill(t.ctx, t.gateway, security, BLOCK, VALID_FIRST_TOKEN)
    try:
        refused = poll_until(lambda: _gateway_rejected(cluster, "bad_proof") > before, 30)
    finally:
        fake.close()
    result.sent = 1
    if not refused:
        result.failures.append("the decode credential's prefill registration was not refused")
    if fake.events:
        result.failures.append("the impostor prefill worker was given a job")


def stamped_lora_list(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    seen = len(cluster.log)
    sock = roles.stamped_lora_list(t.ctx, t.gateway, roles.another_member(t.key_file, "decode"), "lora-stamper")
    try:
        ignored = poll_until(
            lambda: any("reports a LoRA list no gateway signed" in line for line in cluster.log[seen:]), 30
        )
        models = {m["id"] for m in httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"]}
    finally:
        sock.send(encode(Goodbye("lora-stamper")))
        sock.close(linger=1000)
    poll_until(lambda: not cluster.serve.registered("lora-stamper"), 30)
    result.sent = 1
    if not ignored:
        result.failures.append("the stamped LoRA list was not reported as ignored")
    if "sql-assistant" in models:
        result.failures.append("the stamped LoRA list was adopted")


def foreign_abort(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """Another decode member aborts jobs in flight on every prefill worker: refused (not_assigned); the
    load's exact answers show none was aborted."""
    intruder = roles.another_member(t.key_file, "decode")
    prefill = [w["address"] for w in cluster.workers() if w["id"].startswith("prefill")]
    for _ in range(3):
        since = len(cluster.log)
        job = poll_until(lambda: in_flight_job(cluster, since), 30, poll_s=0.01)
        if job is None:
            result.failures.append("no prefill job seen to abort")
            return
        for address in prefill:
            roles.foreign_abort(t.ctx, address, intruder, job[1])
            result.sent += 1


def shm_window_write(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """A key holder on the same host asks, over shm, for the window of a transfer in flight and writes and
    commits into it: no window is granted (not_assigned), so nothing it holds maps the decode worker's
    memory; the load's exact answers show no block moved."""
    for _ in range(3):
        since = len(cluster.log)
        job = poll_until(lambda: in_flight_job(cluster, since), 30, poll_s=0.01)
        if job is None:
            result.failures.append("no prefill job seen to write into")
            return
        decode_worker, rid, generation = job
        address = kv_address(cluster, decode_worker)
        sender = hostile.kv_sender(t.ctx, address, hostile.key_holder(t.key_file), BLOCK, transports=("shm",))
        try:
            sender.send(rid, generation, [0], [0])
            sender.commit(rid, generation, first_token=VALID_FIRST_TOKEN)
            events = hostile.drive(sender, lambda events: bool(events))
        finally:
            sender.channel.close()
        result.sent += 2
        if sender.transport != "shm":
            result.failures.append(f"the receiver chose {sender.transport}, not shm")
        if not events or any(e.ok for e in events):
            result.failures.append(f"a shm write for {rid} was not refused: {events}")


def routing_id_squatting(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """decode-0 is killed under load; another decode member registers as decode-0 while it restarts:
    refused (identity_taken), and the restarted decode-0 takes its id back."""
    intruder = roles.another_member(t.key_file, "decode")
    old = cluster.serve.registered("decode-0")
    before = _gateway_rejected(cluster, "identity_taken")
    cluster.serve.signal("decode-0", signal.SIGKILL)
    sock = roles.squat(t.ctx, t.gateway, intruder, "decode-0")
    try:
        refused = poll_until(lambda: _gateway_rejected(cluster, "identity_taken") > before, 30)
        cluster.serve.wait_restarted("decode-0", old["incarnation"], timeout_s=120)
    finally:
        sock.close(linger=0)
    result.sent = 1
    if not refused:
        result.failures.append("the squat was not refused")
    if cluster.serve.registered("decode-0")["address"] == "tcp://127.0.0.1:9":
        result.failures.append("decode-0's id was squatted")


ROLE_ATTACKS = {
    "decode credential posing as prefill": decode_posing_as_prefill,
    "LoRA list stamped in a heartbeat": stamped_lora_list,
    "foreign AbortRequest": foreign_abort,
    "shm write outside the reserved blocks": shm_window_write,
    "routing-id squatting across a restart": routing_id_squatting,
}
RESTARTS = {"routing-id squatting across a restart": {"decode-0"}}  # the attack kills it itself
