"""CurveZMQ on the worker plane: a credential per role (protocol/role_keys.py), ephemeral client keys.

Each process holds its role's credential (``pdserve keygen --out DIR``: ``<role>.key`` with ``roles.pub``
beside it), or a legacy cluster secret from which every role's credential is derived (HKDF-SHA256):

    server keypair     every socket a role binds (gateway worker ROUTER, prefill job ROUTER, decode KV
                       ROUTER) is a CURVE server with that role's keypair; a client pins the public key
                       of the role it means to reach, so a member of another role cannot answer for it.
    member key         Ed25519; a worker proves its role in its Heartbeat: a signature over its role, its
                       client public key, worker id and incarnation, checked against the keys roles.pub
                       lists for that role (reread when it changes: rotation without a restart).

Each process makes its own client keypair at start (never stored). A server's ZAP handler accepts any
client key that completed the handshake and stamps its frames with it (the ``User-Id`` property), so
a server knows which peer sent each frame: the gateway binds a worker id to the key that registered it
(and to the member key that signed it), a decode worker takes KV only from the key of the prefill worker
it was assigned.

``PlaneSecurity(None)`` is the explicit opt-out (``transfer.insecure``): plain TCP, no peer keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from protocol.key_file_mode import KeyFileModeError, check_private
from protocol.role_keys import (
    PUBLIC_FILE,
    ROLE_KEY_HEADER,
    ROLES,
    PublicSet,
    RoleFile,
    RoleKeyError,
    RoleSet,
    member_public,
    server_public,
    sign,
    verify,
)

log = logging.getLogger(__name__)

SECRET_BYTES = 32
ZAP_DOMAIN = b"pdserve"
_SERVER_LABEL = b"pdserve curve server keypair v1"
_REGISTRATION_LABEL = b"pdserve worker registration v2"
_PROOF_LABEL = b"pdserve registration proof v2"


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
    """What one process holds: the server secret of its role's sockets, its member signing seed(s), and
    the public set (every role's server key, every accepted signer). A legacy cluster secret holds
    every role's; a role key file (protocol/role_keys.py) only its own."""

    role: str  # the role this credential is for; "" for a legacy cluster secret (every role)
    server_secrets: dict[str, bytes]  # role -> z85 CURVE server secret this holder may bind with
    signing_seeds: dict[str, bytes]  # role -> the Ed25519 member seed this holder signs with
    public: PublicSet  # every role's server public key and accepted signers (reread on change)

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKey:
        if len(secret) != SECRET_BYTES:
            raise ClusterKeyError(f"a cluster key is {SECRET_BYTES} bytes, got {len(secret)}")
        # One server keypair for every role (what the secret always derived) and a signer per role.
        server_seed = hkdf_sha256(secret, _SERVER_LABEL)
        seeds = {role: hkdf_sha256(secret, _REGISTRATION_LABEL + b" " + role.encode()) for role in ROLES}
        roles = RoleSet(
            {role: server_public(server_seed) for role in ROLES},
            {role: (member_public(seed),) for role, seed in seeds.items()},
        )
        server_secret = z85.encode(server_seed)
        return cls("", {role: server_secret for role in ROLES}, seeds, PublicSet("", roles))

    @classmethod
    def from_role_file(cls, role_file: RoleFile, public: PublicSet) -> ClusterKey:
        own = public.roles.servers[role_file.role]
        if server_public(role_file.server_seed) != own:
            raise ClusterKeyError(f"{public.path}: the {role_file.role} server key is not this key file's")
        secrets_ = {role_file.role: z85.encode(role_file.server_seed)}
        return cls(role_file.role, secrets_, {role_file.role: role_file.member_seed}, public)

    @classmethod
    def from_file(cls, path: str) -> ClusterKey:
        try:
            st = os.stat(path)
            text = open(path, encoding="ascii").read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterKeyError(f"cluster key file {path}: {exc}") from None
        try:
            check_private(path, st)  # refused, not warned: a key others can read is everyone's
        except KeyFileModeError as exc:
            raise ClusterKeyError(str(exc)) from None
        if text.startswith(ROLE_KEY_HEADER):
            try:
                public = PublicSet.load(os.path.join(os.path.dirname(path), PUBLIC_FILE))
                return cls.from_role_file(RoleFile.parse(text, path), public)
            except RoleKeyError as exc:
                raise ClusterKeyError(str(exc)) from None
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ClusterKeyError(
                f"cluster key file {path}: expected {2 * SECRET_BYTES} hex characters "
                "(write one with `pdserve keygen > FILE`)"
            ) from None
        return cls.from_secret(secret)

    def server_public(self, role: str) -> bytes:
        """What a client pins to reach a socket bound by ``role``."""
        return self.public.current().servers[role]

    def registration_proof(self, client_public: bytes, role: str, worker_id: str, incarnation: str) -> str:
        seed = self.signing_seeds.get(role)
        if seed is None:
            raise ClusterKeyError(f"this {self.role} credential cannot sign as {role}")
        return sign(seed, _proof_message(client_public, role, worker_id, incarnation))

    def verify_registration(
        self, client_public: bytes, role: str, worker_id: str, incarnation: str, proof: str
    ) -> bool:
        """Whether ``proof`` was signed by a key accepted for ``role`` (now: rotation rereads the set)."""
        message = _proof_message(client_public, role, worker_id, incarnation)
        return any(verify(key, message, proof) for key in self.public.current().members.get(role, ()))

    def sign_as(self, role: str, message: bytes) -> str:
        """A signature by this holder's ``role`` member key (a gateway signs the LoRA list it makes)."""
        seed = self.signing_seeds.get(role)
        if seed is None:
            raise ClusterKeyError(f"this {self.role} credential cannot sign as {role}")
        return sign(seed, message)

    def signed_by(self, role: str, message: bytes, signature: str) -> bool:
        """Whether a key accepted for ``role`` signed ``message``."""
        return any(verify(key, message, signature) for key in self.public.current().members.get(role, ()))

    def signer_of(self, client_public: bytes, role: str, worker_id: str, incarnation: str, proof: str) -> bytes:
        """The accepted public key that signed ``proof`` (b"" when none): what a worker id is bound to."""
        message = _proof_message(client_public, role, worker_id, incarnation)
        for key in self.public.current().members.get(role, ()):
            if verify(key, message, proof):
                return key
        return b""


def _proof_message(client_public: bytes, role: str, worker_id: str, incarnation: str) -> bytes:
    # The role is inside the signed message: a decode credential's proof never reads as a prefill one.
    return b"\0".join((_PROOF_LABEL, role.encode(), client_public, worker_id.encode(), incarnation.encode()))


class PlaneSecurity:
    """One process's CURVE settings: its cluster key (None: insecure) and its own client keypair."""

    def __init__(self, key: ClusterKey | None, role: str = ""):
        self.key = key
        self.role = role or (key.role if key is not None else "")  # whose sockets this process binds
        if key is not None and key.role and role and role != key.role:
            raise ClusterKeyError(f"a {key.role} key file given to a {role}: mount each role's own key")
        self.client_public, self._client_secret = zmq.curve_keypair() if key is not None else (b"", b"")
        self._authenticators: dict[int, ThreadAuthenticator] = {}  # C context address -> its ZAP handler

    @property
    def is_secure(self) -> bool:
        return self.key is not None

    def server(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (not yet bound) a CURVE server whose frames carry the client's key."""
        if self.key is not None:
            secret = self.key.server_secrets.get(self.role or "gateway")
            if secret is None:
                raise ClusterKeyError(f"this {self.key.role} credential cannot bind as {self.role or 'gateway'}")
            self._start_zap(sock.context)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        return sock

    def client(self, sock: zmq.Socket, server_role: str = "gateway") -> zmq.Socket:
        """Make ``sock`` (not yet connected) a CURVE client that only talks to a server of ``server_role``:
        a member of another role lacks that role's server secret and cannot answer the handshake."""
        if self.key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.key.server_public(server_role))
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._client_secret)
        return sock

    def registration_proof(self, worker_id: str, incarnation: str, role: str = "") -> str:
        """Signed over this process's client key and ``role`` (its own unless a test claims another)."""
        if self.key is None:
            return ""
        return self.key.registration_proof(self.client_public, role or self.role, worker_id, incarnation)

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


def plane_security(key_file: str, insecure: bool, role: str = "gateway") -> PlaneSecurity:
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
    return PlaneSecurity(ClusterKey.from_file(key_file), role)
