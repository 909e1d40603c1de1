"""``pdserve keygen --out DIR``: the worker plane's credentials, one per role (docs/security.md).

``--out DIR`` writes ``gateway.key``, ``prefill.key``, ``decode.key`` (0600) and ``roles.pub``: mount
each role's file with roles.pub beside it (``transfer.cluster_key_file=/run/secrets/<role>.key``) into
that role's pods only. ``--out DIR --add ROLE --name NAME`` adds a member key of ROLE (a rotation, or
one key per member): its public key is appended to roles.pub, which every process rereads when it
changes. Without ``--out``: one legacy cluster secret on stdout, every role in one file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from protocol.curve import new_secret_text
from protocol.role_keys import ROLES, add_member, new_role_set


def write_private_key(directory: str | None = None) -> str:
    """A new key file, mode 0600, in a new private (0700) directory; returns its path. ``pdserve serve``
    hands its cluster the path (never the key) and removes the directory at exit."""
    folder = tempfile.mkdtemp(prefix="pdserve-key-", dir=directory)  # mkdtemp makes it 0700
    path = os.path.join(folder, "cluster.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret_text())
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve keygen", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for a role set (made 0700; must not hold one already)")
    p.add_argument("--add", choices=ROLES, help="add a member key of this role to the set in --out")
    p.add_argument("--name", help="file name (without .key) of the added member key")
    args = p.parse_args(argv)
    if args.add and not (args.out and args.name):
        p.error("--add needs --out (the set) and --name (the new key's file name)")
    if args.add:
        print(add_member(args.out, args.add, args.name))
    elif args.out:
        print("\n".join(new_role_set(args.out)))
    else:
        sys.stdout.write(new_secret_text())
    return 0
