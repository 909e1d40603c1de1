"""Credentials per role (protocol/role_keys.py, docs/security.md): a decode credential cannot register as
prefill, answer as a gateway or a prefill server, or squat another member's worker id across a restart;
a new member key is accepted, and a retired one refused, by a running gateway without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

import pytest
import zmq
import zmq.asyncio

from cluster.keygen import main as keygen
from gateway.workers.worker_link import WorkerLink
from protocol.codec import encode
from protocol.curve import ClusterKey, ClusterKeyError, PlaneSecurity
from protocol.rejects import RejectLog
from protocol.role_keys import PUBLIC_FILE, ROLES
from tests import hostile


@pytest.fixture()
def role_dir(tmp_path):
    out = tmp_path / "keys"
    assert keygen(["--out", str(out)]) == 0
    for role in ROLES:
        assert os.stat(out / f"{role}.key").st_mode & 0o777 == 0o600
    return out


def credential(role_dir, name: str, role: str = "") -> PlaneSecurity:
    return PlaneSecurity(ClusterKey.from_file(str(role_dir / f"{name}.key")), role)


def test_each_role_file_holds_only_its_own_secrets(role_dir):
    decode = ClusterKey.from_file(str(role_dir / "decode.key"))
    assert decode.role == "decode" and set(decode.server_secrets) == {"decode"} == set(decode.signing_seeds)
    servers = {role: decode.server_public(role) for role in ROLES}
    assert len(set(servers.values())) == 3  # three server keypairs: pinning one shuts out the others
    with pytest.raises(ClusterKeyError, match="cannot sign as prefill"):
        decode.registration_proof(b"k" * 40, "prefill", "p0", "i")
    with pytest.raises(ClusterKeyError, match="a decode key file given to a prefill"):
        credential(role_dir, "decode", "prefill")


def test_a_client_pinning_one_role_never_reaches_a_server_of_another(role_dir):
    """The decode pool's KV receiver is no gateway: a worker pinning the gateway's key gets no handshake."""
    decode, prefill = credential(role_dir, "decode"), credential(role_dir, "prefill")
    ctx = zmq.Context()
    router = decode.server(ctx.socket(zmq.ROUTER))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    wrong = prefill.client(ctx.socket(zmq.DEALER), "gateway")
    right = prefill.client(ctx.socket(zmq.DEALER), "decode")
    try:
        for sock in (wrong, right):
            sock.connect(f"tcp://127.0.0.1:{port}")
        right.send(b"kv")
        assert router.poll(10_000)
        _, frame = router.recv_multipart(copy=False)
        assert frame.bytes == b"kv" and decode.peer_of(frame) == prefill.client_public.decode()
        assert not router.poll(500)  # the wrong pin never completed a handshake: nothing else arrived
    finally:
        for sock in (router, wrong, right):
            sock.close(linger=0)
        decode.close()
        ctx.term()


async def _registrations(role_dir, attempts) -> tuple[list[str], RejectLog]:
    """Run a gateway's WorkerLink and send each ``(credential, worker_id, role)`` registration from a
    connection of its own, in order (the previous one closed first: a restart); returns who registered."""
    gateway = credential(role_dir, "gateway", "gateway")
    registered: list[str] = []
    rejects = RejectLog(logging.getLogger("test"))
    link = WorkerLink(
        "127.0.0.1", 0, 1 << 20, lambda wid, rec: registered.append(f"{wid}:{rec.role}"), rejects, gateway
    )
    await link.start()
    ctx = zmq.asyncio.Context()
    try:
        for security, worker_id, role in attempts:
            sock = security.client(ctx.socket(zmq.DEALER), "gateway")
            sock.connect(link.address)
            incarnation = uuid.uuid4().hex
            proof = security.registration_proof(worker_id, incarnation, role)
            await sock.send(encode(hostile.heartbeat(worker_id, role, "tcp://127.0.0.1:9", incarnation, proof)))
            before = len(registered) + sum(rejects.counts.values())
            for _ in range(200):
                if len(registered) + sum(rejects.counts.values()) > before:
                    break
                await asyncio.sleep(0.02)
            sock.close(linger=0)
            await asyncio.sleep(0.1)  # the gateway sees the connection go (a restart)
    finally:
        await link.close()
        ctx.term()
    return registered, rejects


def test_the_gateway_takes_a_registration_only_from_a_key_of_that_role(role_dir):
    decode, prefill = credential(role_dir, "decode"), credential(role_dir, "prefill")
    decode_as_prefill = _forged(decode, "prefill")
    attempts = [(decode_as_prefill, "p-evil", "prefill"), (prefill, "p0", "prefill"), (decode, "d0", "decode")]
    registered, rejects = asyncio.run(_registrations(role_dir, attempts))
    assert registered == ["p0:prefill", "d0:decode"]
    assert rejects.counts == {"bad_proof": 1}


def _forged(security: PlaneSecurity, claimed: str) -> PlaneSecurity:
    """A holder of ``security``'s key signing as ``claimed`` with its own seed (what a compromised pod can)."""
    key = security.key
    seed = key.signing_seeds[key.role]
    return PlaneSecurity(ClusterKey(key.role, key.server_secrets, {claimed: seed}, key.public), key.role)


def test_a_worker_id_stays_its_member_key_across_a_restart(role_dir):
    """d0 registers with the decode pool's member key and restarts; another decode member (its own key)
    and a prefill member try its id in between: both refused; d0's restart (same member key, new
    connection and client key) takes it back."""
    assert keygen(["--out", str(role_dir), "--add", "decode", "--name", "decode-b"]) == 0
    first, restarted = credential(role_dir, "decode"), credential(role_dir, "decode")
    other_member, prefill = credential(role_dir, "decode-b"), credential(role_dir, "prefill")
    attempts = [(first, "d0", "decode"), (other_member, "d0", "decode"), (prefill, "d0", "prefill")]
    registered, rejects = asyncio.run(_registrations(role_dir, [*attempts, (restarted, "d0", "decode")]))
    assert registered == ["d0:decode", "d0:decode"]
    assert rejects.counts == {"identity_taken": 2}


def test_member_keys_rotate_without_a_restart(role_dir):
    """The running gateway rereads roles.pub: the added key registers at once; once the old key's line is
    removed, a registration with it is refused, and the new one still registers."""
    gateway = ClusterKey.from_file(str(role_dir / "gateway.key"))
    old = credential(role_dir, "decode")
    incarnation = "i1"
    old_proof = old.registration_proof("d0", incarnation, "decode")
    assert gateway.verify_registration(old.client_public, "decode", "d0", incarnation, old_proof)
    assert keygen(["--out", str(role_dir), "--add", "decode", "--name", "decode-2"]) == 0
    new = credential(role_dir, "decode-2")
    new_proof = new.registration_proof("d1", incarnation, "decode")
    public = role_dir / PUBLIC_FILE
    os.utime(public, (1, 1))  # a distinct mtime even within the filesystem's timestamp granularity
    assert gateway.verify_registration(new.client_public, "decode", "d1", incarnation, new_proof)
    old_line = f"member decode {old.key.public.roles.members['decode'][0].hex()}\n"
    public.write_text(public.read_text().replace(old_line, ""))
    os.utime(public, (2, 2))
    assert not gateway.verify_registration(old.client_public, "decode", "d0", incarnation, old_proof)
    assert gateway.verify_registration(new.client_public, "decode", "d1", incarnation, new_proof)
