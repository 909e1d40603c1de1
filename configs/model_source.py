"""Where a role's model comes from: the one resolution every role (gateway, prefill, decode, the
``pdserve serve`` supervisor, ``pdserve generate``) runs before it does anything else.

``model.path`` is one of
- "" : the embedded default model, made on first use in the cache directory (``make_model``, which
  imports torch, runs only then: the gateway stays torch-free once the cache holds it);
- a local directory holding a Hugging Face checkpoint;
- a hub id (``Org/Name``), fetched into (or found in) the Hugging Face cache. The gateway asks for the
  config and tokenizer files only, the workers for the weights too;
- a GGUF file, or a directory holding one: materialised once as a checkpoint directory of config and
  tokenizer that points at the file (configs/gguf_source.py); the engine reads the weights from the file.

Whatever is wrong is a ``ModelSourceError`` (a ``ConfigError``) with one line naming the model and the
problem: a missing path, a hub id the hub cannot provide (offline, unknown, gated), a directory without
``config.json``, an architecture the engine does not run. Every role exits with ``EX_CONFIG`` on it, and
the supervisor does not restart a child that did.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from configs.gguf_config import GGUFError
from configs.gguf_source import find_gguf, is_materialised, materialise
from configs.schema import ConfigError

DEFAULT_FAMILY = "llama"
DEFAULT_SIZE = "small"
CHECKPOINT_VERSION = 3  # bump when make_model's output changes, so stale caches are not reused

# architecture name in config.json -> the engine's family name (engine/model/config.py builds on it)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_TOKENIZER_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_WEIGHT_PATTERNS = ["*.safetensors"]
# The hub's repo id shape: "name" or "namespace/name"; anything else can only be meant as a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelSourceError(ConfigError):
    """The configured model cannot be used; the message is the one line a role prints before exiting."""


def resolve_model(path: str, cache_dir: str = "", *, weights: bool = True) -> Path:
    """The local checkpoint directory ``model.path`` names, checked to be one the engine runs."""
    directory = default_model_dir(cache_dir) if not path else _locate(path, weights, cache_dir)
    check_checkpoint(directory, path or "the default model")
    return directory


def check_checkpoint(directory: Path, given: str) -> None:
    """A directory with a readable ``config.json`` of a supported architecture, else ModelSourceError."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"model {given!r}: {directory} has no config.json (not a Hugging Face checkpoint)")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"model {given!r}: cannot read {config_file}: {exc}") from None
    if not isinstance(hf, dict):
        raise ModelSourceError(f"model {given!r}: {config_file} is not a JSON object")
    architectures = hf.get("architectures") or []
    if not any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        raise ModelSourceError(
            f"model {given!r}: unsupported architecture {architectures or None} (model_type "
            f"{hf.get('model_type')!r}); pdserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _locate(path: str, weights: bool, cache_dir: str) -> Path:
    local = Path(path).expanduser()
    if local.exists():
        if is_materialised(local):  # a GGUF's directory, passed on by the supervisor or a role
            return local
        try:
            gguf_file = find_gguf(local)
            if gguf_file is not None:
                return materialise(gguf_file, cache_dir)
        except (GGUFError, OSError) as exc:
            raise ModelSourceError(f"model {path!r}: {exc}") from None
        if not local.is_dir():
            raise ModelSourceError(
                f"model {path!r} is a file; expected a checkpoint directory, a .gguf file or a hub id"
            )
        return local
    if not _HUB_ID.match(path):
        raise ModelSourceError(f"model path {path!r} does not exist")
    return _from_hub(path, weights)


def _from_hub(repo_id: str, weights: bool) -> Path:
    from huggingface_hub import snapshot_download  # torch-free; only needed for hub ids

    patterns = _TOKENIZER_PATTERNS + (_WEIGHT_PATTERNS if weights else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # the hub's error classes differ between huggingface_hub versions
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(
            f"model {repo_id!r} is not a local directory and the Hugging Face hub cannot provide it{offline}: {reason}"
        ) from None


def default_model_dir(cache_dir: str = "", family: str = DEFAULT_FAMILY, size: str = DEFAULT_SIZE) -> Path:
    """Path of the cached default checkpoint, creating it (atomically) when missing.

    ``cache_dir`` is the config's ``model.cache_dir``; empty means ``~/.cache/pdserve``.
    """
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "pdserve"
    target = root / "models" / f"{family}-{size}-v{CHECKPOINT_VERSION}"
    if (target / "config.json").exists():
        return target
    # make_model imports torch and transformers: only when the cache lacks the model. It lives with the
    # `pdserve make-model` command; this lazy import is the one place configs reaches up to it.
    from cluster.make_model import make_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    make_model(family, size, staging, seed=0)
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its checkpoint is identical (same seed)
        shutil.rmtree(staging, ignore_errors=True)
    return target
