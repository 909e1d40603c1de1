"""A GGUF file as a checkpoint directory every role can read (torch-free).

``--model x.gguf`` (or a directory holding exactly one ``.gguf``) is materialised once into
``<cache>/gguf/<sha256 of the file>/``: ``config.json`` from the metadata (configs/gguf_config.py),
``tokenizer.json`` and ``tokenizer_config.json`` (chat template, special tokens) from the tokenizer
metadata (configs/gguf_tokenizer.py), and ``gguf_source.json`` naming the file, which the engine's
loader reads the weights from (engine/model/gguf_tensors.py). The gateway then reads the tokenizer as it
reads any checkpoint's, without torch or transformers, and the workers see a directory like any other.
The key is the file's content hash, so a changed file at the same path is materialised again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from configs.gguf_config import GGUFError, hf_config, read_header
from configs.gguf_tokenizer import build_tokenizer

SOURCE_FILE = "gguf_source.json"  # in a materialised directory: {"gguf": absolute path, "sha256": ...}
_FORMAT = 1  # bump when what is materialised changes, so stale directories are not reused


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, the one ``.gguf`` in a directory, or the file a
    materialised directory points at; None when ``path`` is no GGUF model (a HF checkpoint, say)."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_magic(path) else None
    if (path / SOURCE_FILE).is_file():
        return Path(json.loads((path / SOURCE_FILE).read_text(encoding="utf-8"))["gguf"])
    if (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); name one")
    return files[0] if files else None


def is_materialised(path: Path) -> bool:
    """A directory ``materialise`` made (its config and tokenizer are in place)."""
    return (path / SOURCE_FILE).is_file() and (path / "config.json").is_file()


def materialise(gguf_file: Path, cache_dir: str = "") -> Path:
    """The checkpoint directory of ``gguf_file`` (made once, atomically); GGUFError when it cannot be served."""
    if not _has_magic(gguf_file):
        raise GGUFError("not a GGUF file (its first bytes are not 'GGUF')")
    digest = _sha256(gguf_file)
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "pdserve"
    target = root / "gguf" / f"{digest[:32]}-v{_FORMAT}"
    if (target / SOURCE_FILE).is_file():
        _point_at(target, gguf_file, digest)  # the same bytes may have moved since
        return target
    header, _reader = read_header(gguf_file)
    config = hf_config(header)
    tokenizer, tokenizer_config = build_tokenizer(header.metadata)
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    tokenizer.save(str(staging / "tokenizer.json"))
    _point_at(staging, gguf_file, digest)
    try:
        staging.rename(target)
    except OSError:  # another role won the race; its directory is identical (same bytes)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _point_at(directory: Path, gguf_file: Path, digest: str) -> None:
    record = {"gguf": str(gguf_file.resolve()), "sha256": digest}
    source = directory / SOURCE_FILE
    if source.is_file() and json.loads(source.read_text(encoding="utf-8")) == record:
        return
    staged = directory / f".{SOURCE_FILE}.{os.getpid()}"
    staged.write_text(json.dumps(record), encoding="utf-8")
    staged.replace(source)


def _has_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
