"""Tiny random checkpoints for tests: built once per process with ``make_model``, kept in a temp dir."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from cluster.make_model import make_model


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pdserve-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_model_dir(family: str, seed: int = 0) -> Path:
    """A ``tiny`` checkpoint of ``family`` ("llama", "mistral", "qwen2", "qwen3")."""
    return make_model(family, "tiny", _root() / f"{family}-tiny-{seed}", seed=seed)
