"""``time_forms``' picks kept on disk, one file per machine and model shape, so a worker that starts
again on the same machine (a restart, a scale-up, the next system of a benchmark) skips the timing.

Timing every form at every row bucket is most of a CPU worker's start: 7.0 of the 7.6 s it took to
build the ``small`` model's engine on one thread (2026-11-25, a 2-core EPYC), and ``pdserve serve``
times its workers one after another (``exclusive_timing``). The picks depend only on what the key
holds: the weight shapes and thread count (the in-process key), the CPU (its model name and flags),
torch's version and the C kernels' build (its file name carries a hash of their source).

``PDSERVE_CPU_FORMS_CACHE_DIR`` (default ``~/.cache/pdserve/cpu-forms``) holds the files;
``PDSERVE_RETIME_CPU_FORMS=1`` times at start anyway and rewrites the file (after moving the disk
to other hardware under the same CPU name, or to re-measure on an idle machine). A file that cannot
be read, or names forms or buckets this build does not have, is timed again and rewritten; one that
cannot be written leaves the worker timing at each start, as before. The quantized weights' forms
(engine/quant/forms.py) are kept here too, keyed by the quantized kernels' build and the formats.

A planted file would steer which forms run (not what they compute, but a slow form is a denial of
service), so the directory follows kernels/cpu/trusted_cache.py's rules as the kernel cache does:
this user's, writable by no one else (tightened and emptied where it was not), and a file that is
not this user's own, or that others may write, is removed and timed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import trusted_cache

log = logging.getLogger(__name__)

T = TypeVar("T")

Picks = dict[str, tuple[tuple[str, ...], str]]  # group -> (form per row bucket, prefill form): the float forms
BucketPicks = dict[
    str, tuple[str, ...]
]  # group -> form per row bucket: the quantized forms, which have no prefill pick


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_CPU_FORMS_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve" / "cpu-forms"


def path_for(key: tuple, native_name: str | None) -> Path:
    text = "\0".join([repr(key), cpu_build.cpu_identity(), torch.__version__, native_name or "-"])
    return cache_dir() / f"forms-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _trusted(path: Path) -> bool:
    """Whether ``path`` may be read: in a private directory, a regular file of this user's that no one
    else may write. An untrusted file is removed (the caller times again and rewrites it)."""
    try:
        trusted_cache.private_dir(path.parent)
        info = os.lstat(path)
    except trusted_cache.KernelCacheError as e:
        log.warning("CPU matmul forms cache not used: %s", e)
        return False
    except OSError:  # none yet
        return False
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022:
        return True
    log.warning("CPU matmul forms cache %s is not this user's own file: removed, timing again", path)
    path.unlink(missing_ok=True)
    return False


def load(
    path: Path,
    groups: list[str],
    forms: tuple[str, ...],
    num_buckets: int,
    prefill_forms: tuple[str, ...] = ("packed", "plain"),
) -> Picks | None:
    """The float picks stored at ``path`` when they cover exactly ``groups`` with known forms; else None."""

    def parse(entry: dict) -> tuple[tuple[str, ...], str]:
        if entry["prefill"] not in prefill_forms:
            raise ValueError(f"unknown prefill form {entry['prefill']!r}")
        return _per_bucket(entry, forms, num_buckets), entry["prefill"]

    return _load(path, groups, parse)


def load_per_bucket(path: Path, groups: list[str], forms: tuple[str, ...], num_buckets: int) -> BucketPicks | None:
    """The quantized picks stored at ``path`` (a form per row bucket) when they cover exactly ``groups``
    with known forms; else None. Files written before they lost their constant ``"prefill": "panel"``
    (no pick: every prompt row count past the buckets takes the last bucket's form) still carry it; it is
    ignored, so those files stay readable and no worker times again for it."""
    return _load(path, groups, lambda entry: _per_bucket(entry, forms, num_buckets))


def _load(path: Path, groups: list[str], parse: Callable[[dict], T]) -> dict[str, T] | None:
    if os.environ.get("PDSERVE_RETIME_CPU_FORMS") == "1" or not _trusted(path):
        return None
    try:
        stored = json.loads(path.read_text())
        if set(stored) != set(groups):
            raise ValueError("other weight groups")
        return {g: parse(stored[g]) for g in groups}
    except OSError:  # none yet
        return None
    except (ValueError, KeyError, TypeError):  # not JSON, or not this shape
        log.warning("CPU matmul forms cache %s is damaged or from another build; timing again", path)
        return None


def _per_bucket(entry: dict, forms: tuple[str, ...], num_buckets: int) -> tuple[str, ...]:
    per_bucket = tuple(entry["per_bucket"])
    if len(per_bucket) != num_buckets or not all(f in forms for f in per_bucket):
        raise ValueError(f"per-bucket forms {per_bucket!r} are not {num_buckets} of {forms}")
    return per_bucket


def store(path: Path, picks: Picks) -> None:
    """Writes the float ``picks`` to ``path`` whole or not at all."""
    _write(
        path, {g: {"per_bucket": list(per_bucket), "prefill": prefill} for g, (per_bucket, prefill) in picks.items()}
    )


def store_per_bucket(path: Path, picks: BucketPicks) -> None:
    """Writes the quantized ``picks`` to ``path`` whole or not at all."""
    _write(path, {g: {"per_bucket": list(per_bucket)} for g, per_bucket in picks.items()})


def _write(path: Path, entries: dict[str, dict]) -> None:
    """``entries`` as JSON at ``path``, whole or not at all (a temporary file renamed over it)."""
    body = json.dumps(entries, indent=1)
    tmp = None
    try:
        trusted_cache.private_dir(path.parent)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except (OSError, trusted_cache.KernelCacheError) as e:  # read-only, full or not ours: timed at each start
        log.warning("CPU matmul forms not cached at %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
