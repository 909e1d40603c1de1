"""Attacks by a key holder of one role on a cluster whose roles hold their own credentials (#47,
protocol/role_keys.py): what a compromised decode pod (its key file, roles.pub beside it) tries."""

from __future__ import annotations

import os
import uuid

import zmq

from cluster.keygen import main as keygen
from protocol.codec import encode
from protocol.curve import ClusterKey, PlaneSecurity
from protocol.serving import AbortRequest
from tests import hostile


def member_key_file(pid: int) -> str:
    """The key file a running member was handed (what a compromised pod reads from its own mount)."""
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PDSERVE_TRANSFER_CLUSTER_KEY_FILE=")]
    assert found and found[0], "the member has no key file of its own"
    return found[0]


def posing_as(key_file: str, claimed: str) -> PlaneSecurity:
    """That member's credential signing its registrations as ``claimed`` with its own member key: the
    most a holder can do, since it has no other role's key."""
    key = ClusterKey.from_file(key_file)
    seed = key.signing_seeds[key.role]
    return PlaneSecurity(ClusterKey(key.role, key.server_secrets, {claimed: seed}, key.public), key.role)


def another_member(key_file: str, role: str) -> PlaneSecurity:
    """A second member of ``role`` (another pod of the pool, compromised): a key of its own, listed in
    roles.pub (which every process rereads)."""
    name = f"{role}-intruder-{uuid.uuid4().hex[:6]}"
    assert keygen(["--out", os.path.dirname(key_file), "--add", role, "--name", name]) == 0
    return PlaneSecurity(ClusterKey.from_file(os.path.join(os.path.dirname(key_file), f"{name}.key")))


def stamped_lora_list(ctx: zmq.Context, gateway: str, security: PlaneSecurity, worker_id: str) -> zmq.Socket:
    """A decode member's heartbeat (valid registration, draining: nothing routed to it) that reports a LoRA
    list of its own making, stamped above any gateway's, mapping a tenant's name to its own weights."""
    sock = hostile.dealer(ctx, gateway, security)
    incarnation = uuid.uuid4().hex
    proof = security.registration_proof(worker_id, incarnation, "decode")
    hb = hostile.heartbeat(worker_id, "decode", "tcp://127.0.0.1:9", incarnation, proof, draining=True)
    hb.lora_set_version, hb.lora_set_gateway = 10**6, "zz-forged"
    hb.lora_set_names, hb.lora_set_paths = ["sql-assistant"], ["/shared/cache/backdoor"]
    sock.send(encode(hb))
    return sock


def foreign_abort(ctx: zmq.Context, prefill: str, security: PlaneSecurity, rid: str) -> None:
    """An AbortRequest for another decode worker's job, straight to the prefill worker's job socket."""
    sock = hostile.dealer(ctx, prefill, security, server_role="prefill")
    sock.send(encode(AbortRequest(rid, "not mine to abort")))
    sock.close(linger=2000)


def squat(ctx: zmq.Context, gateway: str, security: PlaneSecurity, worker_id: str) -> zmq.Socket:
    """Register under ``worker_id`` (its owner is restarting) with another member's key."""
    sock = hostile.dealer(ctx, gateway, security)
    hostile.register(sock, security, worker_id, "decode", "tcp://127.0.0.1:9")
    return sock
