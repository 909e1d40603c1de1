"""Moved to configs/model_source.py, which every role may import (cluster/ sits above the roles).
Kept so that code written against the old path still runs."""

from configs.model_source import CHECKPOINT_VERSION, DEFAULT_FAMILY, DEFAULT_SIZE, default_model_dir, resolve_model

__all__ = ["CHECKPOINT_VERSION", "DEFAULT_FAMILY", "DEFAULT_SIZE", "configured_model_path", "default_model_dir"]


def configured_model_path(path: str, cache_dir: str = "") -> str:
    return str(resolve_model(path, cache_dir))
