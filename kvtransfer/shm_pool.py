"""Tensors that live in ``/dev/shm`` so another process on the host can map them.

The decode node allocates its KV pool here when it offers the ``shm`` transport, then builds
``KVPool(layout, tensor=shared.tensor)``; the prefill node maps the same file and writes straight into
reserved blocks. ``torch.from_file(shared=True)`` maps the file without the buffer-export and
resource-tracker pitfalls of ``multiprocessing.shared_memory``.

Capacity: a tmpfs file is sparse, so a pool larger than what ``/dev/shm`` has left would map fine and
die of SIGBUS at the first write to a page the filesystem cannot supply (Docker's default ``/dev/shm`` is
64 MB). ``create_shared`` checks the free space first and then reserves every page (``posix_fallocate``,
which also catches two processes racing for the last space): either the whole file is backed or
``ShmCapacityError`` names both sizes, and the caller picks another transport.

Names are ``pdserve-<prefix>-<uuid>``; the decode worker's prefixes end in its pid (``kv-<pid>``,
``fence-<pid>``) so a supervisor can remove the files of a worker that was killed (it cannot unlink
them itself): see ``cluster/local_cluster.py``.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^pdserve-[A-Za-z0-9_.-]{1,100}$")  # a peer sends us names: no paths, no '..'


class ShmCapacityError(OSError):
    """``/dev/shm`` cannot hold the tensor; the message names the bytes needed and the bytes free."""


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


@dataclass(slots=True)
class SharedTensor:
    name: str  # file name under /dev/shm, what travels in the handshake
    tensor: torch.Tensor
    is_owner: bool  # the creator unlinks

    def unlink(self) -> None:
        if self.is_owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass


def create_shared(shape: tuple[int, ...], dtype: torch.dtype, prefix: str = "kv") -> SharedTensor:
    name = f"pdserve-{prefix}-{uuid.uuid4().hex}"
    numel = math.prod(shape)
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    free = shm_free_bytes()
    if num_bytes > free:
        raise ShmCapacityError(
            f"{SHM_DIR} has {free} bytes free ({free / 2**20:.1f} MiB); the shared tensor needs "
            f"{num_bytes} ({num_bytes / 2**20:.1f} MiB)"
        )
    _reserve(_path(name), num_bytes)
    flat = torch.from_file(_path(name), shared=True, size=numel, dtype=dtype)  # zero-filled new file
    return SharedTensor(name, flat.view(shape), is_owner=True)


def _reserve(path: str, num_bytes: int) -> None:
    """Create ``path`` with every one of its ``num_bytes`` backed, or raise ShmCapacityError (no file left)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if num_bytes:
            os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        os.unlink(path)
        raise ShmCapacityError(
            f"{SHM_DIR} could not reserve {num_bytes} bytes ({num_bytes / 2**20:.1f} MiB) for "
            f"a shared tensor: {e.strerror}"
        ) from None
    finally:
        os.close(fd)


def attach_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SharedTensor:
    numel = math.prod(shape)
    path = _path(name)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if os.path.getsize(path) != expected:  # never map past (or short of) what the owner allocated
        raise ValueError(f"shared tensor {name} has {os.path.getsize(path)} bytes, expected {expected}")
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    return SharedTensor(name, flat.view(shape), is_owner=False)


def _path(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"invalid shared tensor name {name[:120]!r}")
    return os.path.join(SHM_DIR, name)
