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
cannot be written leaves the worker timing at each start, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from kernels.cpu import build as cpu_build

log = logging.getLogger(__name__)

Picks = dict[str, tuple[tuple[str, ...], str]]  # group -> (form per row bucket, prefill form)


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_CPU_FORMS_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve" / "cpu-forms"


def path_for(key: tuple, native_name: str | None) -> Path:
    text = "\0".join([repr(key), cpu_build.cpu_identity(), torch.__version__, native_name or "-"])
    return cache_dir() / f"forms-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def load(path: Path, groups: list[str], forms: tuple[str, ...], num_buckets: int) -> Picks | None:
    """The picks stored at ``path`` when they cover exactly ``groups`` with known forms; else None."""
    if os.environ.get("PDSERVE_RETIME_CPU_FORMS") == "1":
        return None
    try:
        stored = json.loads(path.read_text())
        picks = {g: (tuple(stored[g]["per_bucket"]), stored[g]["prefill"]) for g in groups}
        valid = set(stored) == set(groups) and all(
            len(per_bucket) == num_buckets and all(f in forms for f in per_bucket) and prefill in ("packed", "plain")
            for per_bucket, prefill in picks.values()
        )
    except OSError:  # none yet
        return None
    except (ValueError, KeyError, TypeError):  # not JSON, or not this shape
        valid = False
    if not valid:
        log.warning("CPU matmul forms cache %s is damaged or from another build; timing again", path)
        return None
    return picks


def store(path: Path, picks: Picks) -> None:
    """Writes ``picks`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    body = json.dumps(
        {g: {"per_bucket": list(per_bucket), "prefill": prefill} for g, (per_bucket, prefill) in picks.items()},
        indent=1,
    )
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:  # read-only or full: the next start times again
        log.warning("CPU matmul forms not cached at %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
