"""A sentencepiece (``tokenizer.ggml.model = llama``) GGUF tokenizer, as Llama 2 and Mistral files carry:
rebuilt by configs/gguf_tokenizer.py without transformers, it equals transformers' own GGUF tokenizer
token for token (byte fallback, the BOS it adds, control tokens kept whole) and decodes the same. The
vocabulary is trained here with ``tokenizers`` and written as llama.cpp lays it out (control tokens,
256 byte tokens, then the pieces, with scores and merges). SmolLM2's byte-level BPE: test_gguf_smollm2.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import SentencePieceBPETokenizer
from transformers import AutoTokenizer

from configs.gguf_config import read_header
from configs.gguf_tokenizer import build_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there!",
    "Paris is the capital of France.",
    "Numbers 123 and 4567.",
    "  spaced   out\ttext\nnew lines",
]
TEXTS = [
    "The quick brown fox",
    "Hello world, hello there!",
    "  spaced   out\ttext\nnew lines",
    "Ünïcödé 東京 🤖 (bytes the vocabulary lacks)",
    "x</s>y<s>",
]
_SPECIAL = ["<unk>", "<s>", "</s>"]
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # llama.cpp's token types


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    trainer = SentencePieceBPETokenizer(add_prefix_space=True)
    trainer.train_from_iterator(CORPUS * 20, vocab_size=400, min_frequency=1, special_tokens=_SPECIAL)
    model = json.loads(trainer.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in _SPECIAL]
    tokens = _SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + pieces
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * len(pieces))
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_gguf_tokenizer_equals_transformers(spm_gguf: Path, text: str) -> None:
    theirs = AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    ours, config = build_tokenizer(read_header(spm_gguf)[0].metadata)
    ids = theirs.encode(text)
    assert ids[0] == 1 and config["add_bos_token"] is True  # llama.cpp adds BOS to a sentencepiece vocabulary
    assert ours.encode(text).ids == ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
