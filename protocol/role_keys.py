"""Credentials per role: the gateway, prefill and decode pools each hold only their own (docs/security.md).

``pdserve keygen --out DIR`` writes one private file per role and one public file every member reads:

    DIR/<role>.key   (0600; mounted only into that role's pods)
        pdserve-role-key v1
        role prefill
        server <64 hex>   seed of the role's CURVE server keypair: the sockets this role binds
        member <64 hex>   seed of this member's Ed25519 signing key: its registration proofs
    DIR/roles.pub    (every member; distributed as the Secrets are: a server public key is what lets a
                      client finish a CURVE handshake, so it is not handed to outsiders)
        server <role> <z85 CURVE public>       what a client of that role's sockets pins
        member <role> <64 hex Ed25519 public>  one line per accepted signer; old and new during a rotation

A client pins the server key of the role it means to reach, so a decode pod, which lacks the gateway's
and the prefill pool's server secrets, cannot answer as either. A worker's Heartbeat is signed with its
member key over its role, so the gateway takes a registration as a prefill worker only from a key listed
under ``member prefill``. ``roles.pub`` is read again when it changes (``PublicSet.current``), so a new
member key is accepted, and a retired one refused, without a restart.

A legacy cluster secret (64 hex characters, one file for every role) still loads: every role's seeds are
derived from it, so any holder is every role; keygen's role set is what separates them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from zmq.utils import z85

ROLES = ("gateway", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode")
ROLE_KEY_HEADER = "pdserve-role-key v1"
PUBLIC_FILE = "roles.pub"


class RoleKeyError(ValueError):
    """A role key file or public file that does not parse."""


def server_public(seed: bytes) -> bytes:
    """The z85 CURVE public key of the server keypair a 32-byte seed stands for."""
    return zmq.curve_public(z85.encode(seed))


def member_public(seed: bytes) -> bytes:
    """The raw Ed25519 public key of a member seed."""
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()


def sign(seed: bytes, message: bytes) -> str:
    return Ed25519PrivateKey.from_private_bytes(seed).sign(message).hex()


def verify(public: bytes, message: bytes, signature_hex: str) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(bytes.fromhex(signature_hex), message)
        return True
    except Exception:  # InvalidSignature, or a signature that is not hex / not 64 bytes
        return False


@dataclass(frozen=True, slots=True)
class RoleFile:
    """One member's private file."""

    role: str
    server_seed: bytes
    member_seed: bytes

    def text(self) -> str:
        return (
            f"{ROLE_KEY_HEADER}\nrole {self.role}\nserver {self.server_seed.hex()}\nmember {self.member_seed.hex()}\n"
        )

    @classmethod
    def parse(cls, text: str, path: str) -> RoleFile:
        lines = text.strip().splitlines()
        fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
        try:
            role, server, member = fields["role"], bytes.fromhex(fields["server"]), bytes.fromhex(fields["member"])
        except (KeyError, ValueError):
            raise RoleKeyError(f"role key file {path}: needs `role`, `server` and `member` lines") from None
        if role not in ROLES or len(server) != 32 or len(member) != 32:
            raise RoleKeyError(f"role key file {path}: role must be one of {ROLES}, seeds 64 hex characters")
        return cls(role, server, member)


@dataclass(frozen=True, slots=True)
class RoleSet:
    """The public half of a cluster's credentials."""

    servers: dict[str, bytes]  # role -> z85 CURVE server public key
    members: dict[str, tuple[bytes, ...]]  # role -> the Ed25519 public keys accepted for it

    def text(self) -> str:
        lines = [f"server {role} {self.servers[role].decode()}" for role in ROLES]
        lines += [f"member {role} {key.hex()}" for role in ROLES for key in self.members.get(role, ())]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, path: str) -> RoleSet:
        servers: dict[str, bytes] = {}
        members: dict[str, list[bytes]] = {role: [] for role in ROLES}
        for number, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if len(parts) != 3 or parts[0] not in ("server", "member") or parts[1] not in ROLES:
                raise RoleKeyError(f"{path}:{number}: expected `server|member <role> <key>`, got {line[:80]!r}")
            try:
                if parts[0] == "server":
                    z85.decode(parts[2].encode())  # raises on a malformed key
                    servers[parts[1]] = parts[2].encode()
                else:
                    members[parts[1]].append(bytes.fromhex(parts[2]))
            except ValueError:
                raise RoleKeyError(f"{path}:{number}: malformed key") from None
        missing = [role for role in ROLES if role not in servers]
        if missing:
            raise RoleKeyError(f"{path}: no server key for {', '.join(missing)}")
        return cls(servers, {role: tuple(keys) for role, keys in members.items()})


@dataclass(slots=True)
class PublicSet:
    """``roles.pub`` as a process sees it now: read again whenever the file's mtime moves (rotation)."""

    path: str
    roles: RoleSet
    _mtime: float = field(default=0.0, compare=False)

    @classmethod
    def load(cls, path: str) -> PublicSet:
        try:
            mtime, text = os.stat(path).st_mtime, open(path, encoding="ascii").read()
        except (OSError, UnicodeDecodeError) as exc:
            raise RoleKeyError(f"public role keys {path}: {exc}") from None
        return cls(path, RoleSet.parse(text, path), mtime)

    def current(self) -> RoleSet:
        if self.path:
            try:
                if os.stat(self.path).st_mtime != self._mtime:
                    fresh = PublicSet.load(self.path)
                    self.roles, self._mtime = fresh.roles, fresh._mtime
            except RoleKeyError:
                pass  # a half-written file mid-rotation: keep the last good set
            except OSError:
                pass
        return self.roles


def new_role_set(directory: str) -> list[str]:
    """``pdserve keygen --out DIR``: a private file per role and ``roles.pub``; returns the paths."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    files = [RoleFile(role, secrets.token_bytes(32), secrets.token_bytes(32)) for role in ROLES]
    roles = RoleSet(
        {f.role: server_public(f.server_seed) for f in files},
        {f.role: (member_public(f.member_seed),) for f in files},
    )
    paths = [write_private(os.path.join(directory, f"{f.role}.key"), f.text()) for f in files]
    # 0600 too: its server public keys are what lets a client finish a handshake (members only)
    return [*paths, write_private(os.path.join(directory, PUBLIC_FILE), roles.text())]


def add_member(directory: str, role: str, name: str) -> str:
    """A new member key for ``role`` (a rotation, or one key per member): the role's server seed from
    ``DIR/<role>.key``, a fresh member seed in ``DIR/<name>.key``, its public key appended to roles.pub."""
    base = os.path.join(directory, f"{role}.key")
    server_seed = RoleFile.parse(open(base, encoding="ascii").read(), base).server_seed
    member = RoleFile(role, server_seed, secrets.token_bytes(32))
    path = write_private(os.path.join(directory, f"{name}.key"), member.text())
    with open(os.path.join(directory, PUBLIC_FILE), "a", encoding="ascii") as out:
        out.write(f"member {role} {member_public(member.member_seed).hex()}\n")
    return path


def write_private(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path
