"""The C kernel cache is trusted only as far as its directory is the serving user's own (#47).

A cached ``.so`` is code the worker runs: a library planted in a shared writable cache directory is
code execution as the serving user. So the cache directory must belong to this user and be writable
by nobody else; one that was writable by others (or is newly made) is tightened to 0700 and emptied of
libraries first, since anything in it may have been planted. Each library built here is sealed with
its SHA-256 in a sidecar (``<name>.so.sha256``), and a cached library is loaded only when it is this
user's, not writable by others, and its bytes still match that digest; anything else is removed and
built again. A directory owned by another user is refused (``KernelCacheError``): the caller falls
back to the torch path and says so.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

LIBRARY_GLOBS = ("cpu_native-*.so", "cpu_decode-*.so", "tmp*.so", "*.so.sha256")


class KernelCacheError(RuntimeError):
    """The kernel cache directory cannot be trusted (another user's)."""


def private_dir(directory: Path) -> Path:
    """``directory`` made (0700) or checked: this user's, writable by no one else."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(directory)
    if info.st_uid != os.geteuid():
        raise KernelCacheError(
            f"kernel cache {directory} belongs to uid {info.st_uid}, not this user ({os.geteuid()}): "
            "set PDSERVE_NATIVE_CACHE_DIR to a directory of this user's"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        for pattern in LIBRARY_GLOBS:  # others could write here: nothing in it is ours for sure
            for path in directory.glob(pattern):
                path.unlink(missing_ok=True)
        os.chmod(directory, 0o700)
    return directory


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def seal(library: Path) -> None:
    """Record the digest of a library just built here (after it is in place)."""
    tmp = _sidecar(library).with_name(_sidecar(library).name + f".{os.getpid()}.tmp")
    tmp.write_text(_digest(library) + "\n")
    os.replace(tmp, _sidecar(library))


def take(library: Path) -> bool:
    """Whether the cached ``library`` may be loaded: in a private cache directory, this user's, writable
    by no one else, and its bytes those it was sealed with. An untrusted one is removed (False)."""
    private_dir(library.parent)
    if not library.exists():
        return False
    info, sidecar = os.lstat(library), _sidecar(library)
    ours = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
    try:
        sealed = sidecar.read_text().strip()
    except OSError:
        sealed = ""
    if ours and sealed and sealed == _digest(library):
        return True
    library.unlink(missing_ok=True)
    sidecar.unlink(missing_ok=True)
    return False
