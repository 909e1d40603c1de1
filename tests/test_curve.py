"""protocol/curve.py: the cluster key's derivations, the membership proof, CURVE sockets that carry the
client's key, and the refusal to run without a key."""

from __future__ import annotations

import os

import pytest
import zmq

from cluster.keygen import write_private_key
from protocol.curve import ClusterKey, ClusterKeyError, PlaneSecurity, hkdf_sha256, new_secret_text, plane_security


def test_hkdf_matches_rfc5869_test_case_3():
    # RFC 5869 A.3: SHA-256, zero-length salt (= 32 zero bytes) and info
    okm = hkdf_sha256(bytes.fromhex("0b" * 22), b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")


def test_key_file_round_trip_and_errors(tmp_path):
    path = write_private_key(str(tmp_path))
    assert (
        oct(os.stat(path).st_mode & 0o777) == "0o600" and oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    )
    key = ClusterKey.from_file(path)
    assert key == ClusterKey.from_secret(bytes.fromhex(open(path).read().strip()))  # deterministic derivation
    assert len(new_secret_text().strip()) == 64
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    bad.chmod(0o600)
    with pytest.raises(ClusterKeyError, match="expected 64 hex characters"):
        ClusterKey.from_file(str(bad))
    bad.write_text("ab" * 16)
    with pytest.raises(ClusterKeyError, match="32 bytes, got 16"):
        ClusterKey.from_file(str(bad))
    with pytest.raises(ClusterKeyError, match="No such file"):
        ClusterKey.from_file(str(tmp_path / "missing"))


def test_no_key_refuses_unless_explicitly_insecure(tmp_path):
    with pytest.raises(ClusterKeyError, match="no cluster key: set transfer.cluster_key_file"):
        plane_security("", insecure=False)
    assert not plane_security("", insecure=True).is_secure
    assert plane_security(write_private_key(str(tmp_path)), insecure=False).is_secure


def test_proof_binds_key_worker_and_incarnation():
    key = ClusterKey.from_secret(bytes(range(32)))
    a, b = PlaneSecurity(key), PlaneSecurity(key)
    proof = a.registration_proof("decode-0", "inc-1", "decode")
    assert key.verify_registration(a.client_public, "decode", "decode-0", "inc-1", proof)
    assert not key.verify_registration(b.client_public, "decode", "decode-0", "inc-1", proof)  # from another key
    assert not key.verify_registration(a.client_public, "decode", "decode-1", "inc-1", proof)
    assert not key.verify_registration(a.client_public, "decode", "decode-0", "inc-2", proof)
    assert not key.verify_registration(a.client_public, "prefill", "decode-0", "inc-1", proof)  # the role is signed
    other = ClusterKey.from_secret(bytes(32))
    assert not other.verify_registration(a.client_public, "decode", "decode-0", "inc-1", proof)


def test_curve_sockets_carry_the_client_key_and_shut_out_other_keys():
    key = ClusterKey.from_secret(bytes(range(32)))
    server_side, member = PlaneSecurity(key), PlaneSecurity(key)
    ctx = zmq.Context()
    sockets = []
    try:
        router = server_side.server(ctx.socket(zmq.ROUTER))
        port = router.bind_to_random_port("tcp://127.0.0.1")
        stranger = PlaneSecurity(ClusterKey.from_secret(bytes(32))).client(ctx.socket(zmq.DEALER))
        plain = ctx.socket(zmq.DEALER)
        client = member.client(ctx.socket(zmq.DEALER))
        sockets += [router, stranger, plain, client]
        for sock in (stranger, plain):  # their frames queue on their side; no handshake ever delivers them
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(b"let me in")
        client.connect(f"tcp://127.0.0.1:{port}")
        for text in (b"hello", b"still here"):
            client.send(text)
            assert router.poll(10_000)
            _, frame = router.recv_multipart(copy=False)
            assert frame.bytes == text and server_side.peer_of(frame) == member.client_public.decode()
    finally:
        for sock in sockets:
            sock.close(linger=0)
        server_side.close()
        ctx.term()
