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


ADDED_IN_GAP_ID = 760  # an added special token above the tokenizer's base vocabulary, within the embedding
ADDED_PAST_EMBEDDING_ID = 800  # one the tokenizer knows but the model's embedding (768 rows) has no row for


@functools.cache
def added_tokens_model_dir() -> Path:
    """The tiny qwen2 checkpoint with a tokenizer laid out as Qwen's released ones are: a base vocabulary
    (here ids 0..699) with added special tokens above it, not contiguous with it (ids 760 and 800), under
    an embedding of 768 rows. The token count (702) is lower than the highest id."""
    import json

    out = _root() / "qwen2-added-tokens"
    shutil.copytree(tiny_model_dir("qwen2"), out)
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"] = {t: i for t, i in tok["model"]["vocab"].items() if i < 700}
    pairs = [m.split(" ") if isinstance(m, str) else m for m in tok["model"]["merges"]]
    tok["model"]["merges"] = [[a, b] for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    for token_id, content in ((ADDED_IN_GAP_ID, "<|extra_0|>"), (ADDED_PAST_EMBEDDING_ID, "<|extra_1|>")):
        vocab[content] = token_id  # in the vocabulary too, or the library renumbers it to the next free id
        tok["added_tokens"].append(
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    path.write_text(json.dumps(tok), encoding="utf-8")
    return out
