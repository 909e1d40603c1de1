"""``pdserve keygen > cluster.key``: a new cluster secret for the worker plane (docs/security.md).

Every gateway and worker of one cluster reads the same file (``transfer.cluster_key_file``); mount it
from a Kubernetes Secret or a compose secret, mode 0400/0600. A new file rotates the key: restart
every process of the cluster with it (a process with the old key can no longer connect).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from protocol.curve import new_secret_text


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
    p.parse_args(argv)
    sys.stdout.write(new_secret_text())
    return 0
