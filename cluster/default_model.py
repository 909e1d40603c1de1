"""The embedded default model: the random-weight ``small`` Llama, made on first use and cached.

No model hub is needed: the checkpoint (weights, tokenizer, chat template) is generated locally by
``make_model`` and reused from the cache directory afterwards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_FAMILY = "llama"
DEFAULT_SIZE = "small"
CHECKPOINT_VERSION = 3  # bump when make_model's output changes, so stale caches are not reused


def default_model_dir(cache_dir: str = "", family: str = DEFAULT_FAMILY, size: str = DEFAULT_SIZE) -> Path:
    """Path of the cached default checkpoint, creating it (atomically) when missing.

    ``cache_dir`` is the config's ``model.cache_dir``; empty means ``~/.cache/pdserve``.
    """
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "pdserve"
    target = root / "models" / f"{family}-{size}-v{CHECKPOINT_VERSION}"
    if (target / "config.json").exists():
        return target
    from cluster.make_model import make_model  # imports torch/transformers: only when needed

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    make_model(family, size, staging, seed=0)
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its checkpoint is identical (same seed)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def configured_model_path(path: str, cache_dir: str = "") -> str:
    """The config's ``model.path``, or (when empty) the embedded default model, made on first use."""
    return path or str(default_model_dir(cache_dir))
