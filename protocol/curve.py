"""CurveZMQ on the worker plane: one cluster secret, a derived server keypair, ephemeral client keys.

The operator gives every process of a cluster the same 32-byte secret (a file: ``pdserve keygen``).
From it each process derives (HKDF-SHA256, fixed labels):

    server keypair     every socket that binds (gateway worker ROUTER, prefill job ROUTER, decode KV
                       ROUTER) is a CURVE server with it; a client must know its public key to finish
                       the handshake, and only holders of the secret do: an outsider cannot connect.
    registration key   a worker proves membership in its Heartbeat: HMAC(key, its client public key,
                       worker id, incarnation). A leaked server public key alone registers nobody.

Each process makes its own client keypair at start (never stored). A server's ZAP handler accepts any
client key that completed the handshake and stamps its frames with it (the ``User-Id`` property), so
a server knows which peer sent each frame: the gateway binds a worker id to the key that registered
it, a decode worker takes KV only from the key of the prefill worker it was assigned.

``PlaneSecurity(None)`` is the explicit opt-out (``transfer.insecure``): plain TCP, no peer keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_BYTES = 32
ZAP_DOMAIN = b"pdserve"
_SERVER_LABEL = b"pdserve curve server keypair v1"
_REGISTRATION_LABEL = b"pdserve worker registration v1"


class ClusterKeyError(ValueError):
    """No usable cluster key: a missing or malformed file, or none configured where one is required."""


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 with an all-zero salt (the secret is already uniformly random)."""
    prk = hmac.new(b"\0" * 32, secret, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def new_secret_text() -> str:
    """What ``pdserve keygen`` writes: 64 hex characters and a newline."""
    return secrets.token_bytes(SECRET_BYTES).hex() + "\n"


@dataclass(frozen=True, slots=True)
class ClusterKey:
    server_public: bytes  # z85, 40 bytes: what clients pin
    server_secret: bytes  # z85
    _registration: bytes  # HMAC key of worker registrations

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKey:
        if len(secret) != SECRET_BYTES:
            raise ClusterKeyError(f"a cluster key is {SECRET_BYTES} bytes, got {len(secret)}")
        server_secret = z85.encode(hkdf_sha256(secret, _SERVER_LABEL))
        return cls(zmq.curve_public(server_secret), server_secret, hkdf_sha256(secret, _REGISTRATION_LABEL))

    @classmethod
    def from_file(cls, path: str) -> ClusterKey:
        try:
            mode = os.stat(path).st_mode
            text = open(path, encoding="ascii").read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterKeyError(f"cluster key file {path}: {exc}") from None
        if mode & stat.S_IRWXO and not stat.S_ISLNK(mode):
            # Kubernetes mounts Secrets 0644 by default (defaultMode 0400 is advised): warn, do not refuse.
            # Group bits are no warning: with fsGroup the kubelet makes a 0400 Secret 0440, group = the
            # pod's own group, which is how a non-root pod reads it (deploy/k8s).
            log.warning("cluster key file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ClusterKeyError(
                f"cluster key file {path}: expected {2 * SECRET_BYTES} hex characters "
                "(write one with `pdserve keygen > FILE`)"
            ) from None
        return cls.from_secret(secret)

    def registration_proof(self, client_public: bytes, worker_id: str, incarnation: str) -> str:
        message = b"\0".join((client_public, worker_id.encode(), incarnation.encode()))
        return hmac.new(self._registration, message, hashlib.sha256).hexdigest()

    def verify_registration(self, client_public: bytes, worker_id: str, incarnation: str, proof: str) -> bool:
        return hmac.compare_digest(self.registration_proof(client_public, worker_id, incarnation), proof)


class PlaneSecurity:
    """One process's CURVE settings: its cluster key (None: insecure) and its own client keypair."""

    def __init__(self, key: ClusterKey | None):
        self.key = key
        self.client_public, self._client_secret = zmq.curve_keypair() if key is not None else (b"", b"")
        self._authenticators: dict[int, ThreadAuthenticator] = {}  # C context address -> its ZAP handler

    @property
    def is_secure(self) -> bool:
        return self.key is not None

    def server(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (not yet bound) a CURVE server whose frames carry the client's key."""
        if self.key is not None:
            self._start_zap(sock.context)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.key.server_secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        return sock

    def client(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (not yet connected) a CURVE client that only talks to cluster servers."""
        if self.key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.key.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._client_secret)
        return sock

    def registration_proof(self, worker_id: str, incarnation: str) -> str:
        return self.key.registration_proof(self.client_public, worker_id, incarnation) if self.key else ""

    def peer_of(self, frame: zmq.Frame) -> str:
        """The sending client's public key (z85) on a server socket; "" when insecure."""
        if self.key is None:
            return ""
        return frame.get("User-Id")

    def _start_zap(self, ctx: zmq.Context) -> None:
        address = ctx.underlying
        if address in self._authenticators:
            return
        # The handler runs on its own thread with a plain context over the same C context (the caller's
        # may be a zmq.asyncio one); every client key that completes the handshake is let in.
        shadow = zmq.Context.shadow(address)
        shadow.setsockopt(zmq.LINGER, 0)  # its sockets never hold the context's term() open
        auth = ThreadAuthenticator(shadow, log=logging.getLogger("pdserve.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        self._authenticators[address] = auth

    def close(self) -> None:
        """Stop the ZAP handlers; before the contexts they serve are terminated."""
        for auth in self._authenticators.values():
            auth.stop()
        self._authenticators.clear()


INSECURE_WARNING = (
    "WORKER PLANE NOT AUTHENTICATED OR ENCRYPTED (transfer.insecure): anyone who reaches "
    "this process's ports can register fake workers, read prompts and write KV; use only on a "
    "network nobody else can reach"
)


def plane_security(key_file: str, insecure: bool) -> PlaneSecurity:
    """The configured security of a role. No key and no explicit opt-out refuses to start, on any
    interface (``pdserve serve`` makes a key for its own cluster)."""
    if insecure:
        log.warning(INSECURE_WARNING)
        return PlaneSecurity(None)
    if not key_file:
        raise ClusterKeyError(
            "no cluster key: set transfer.cluster_key_file (write one with `pdserve keygen > FILE`), "
            "or transfer.insecure: true on an isolated network"
        )
    return PlaneSecurity(ClusterKey.from_file(key_file))
