"""A GGUF file's tokenizer, rebuilt as the ``tokenizer.json`` + ``tokenizer_config.json`` pair that
``save_pretrained`` writes, with the ``tokenizers`` library only (no transformers, no torch), so the
gateway reads a GGUF's tokenizer the way it reads any checkpoint's (gateway/text/tokenizer.py).

The file stores the vocabulary, merges, token types and special ids under llama.cpp's keys
(``tokenizer.ggml.*``); the rest of the tokenizer is implied by ``tokenizer.ggml.model``:
- ``gpt2``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet; text is split by the regex of
  the vocabulary's ``tokenizer.ggml.pre`` (llama-bpe, qwen2, ...) or GPT-2's own when none is named;
- ``llama``: sentencepiece BPE with byte fallback and a ``▁`` prefix on the first word.
Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens,
so both stay whole in the text. This follows transformers' GGUF tokenizer (integrations/gguf), which
the tests check it against token for token.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from configs.gguf_config import GGUFError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex its merges were learned on; others use GPT-2's ByteLevel regex
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id"}
_SPECIAL_IDS |= {"pad_token": "padding_token_id"}


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """(the tokenizer, its tokenizer_config.json) from the file's ``tokenizer.*`` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("the file carries no tokenizer (tokenizer.ggml.tokens is missing)")
    if kind == "gpt2":
        tokenizer, tokens = _byte_level(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        tokenizer, add_bos_default = _sentencepiece(meta, tokens), True  # llama.cpp adds BOS unless told not to
    else:
        raise GGUFError(
            f"unsupported tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), llama (sentencepiece)"
        )
    _add_marked_tokens(tokenizer, tokens, meta.get("tokenizer.ggml.token_type") or [])
    config = {name: _token(meta, tokens, key) for name, key in _SPECIAL_IDS.items()}
    config |= {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        # transformers then runs tokenizer.json as written rather than rebuilding a model-specific pipeline
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    tokenizer.post_processor = _post_processor(config, tokens)
    return tokenizer, config


def _byte_level(meta: dict, tokens: list[str]) -> tuple[Tokenizer, list[str]]:
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    # A token outside the byte alphabet (a mislabelled control token) is respelled byte by byte.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    model = models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(model)
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece(meta: dict, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if not merges:  # older files: merges implied by the scores, best first (what transformers' generate_merges does)
        merges = _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    prepend = "first" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    strip = [decoders.Strip(" ", 1, 0)] if prepend == "first" else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((score, vocab[left], vocab[right], left, right))
    found.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(left, right) for _, _, _, left, right in found]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    vocab = tokenizer.get_vocab()
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tokenizer.add_special_tokens([t for t in control if t.content in vocab])
    tokenizer.add_tokens([t for t in user if t.content in vocab])


def _post_processor(config: dict, tokens: list[str]) -> processors.TemplateProcessing:
    ids = {t: i for i, t in enumerate(tokens)}
    bos = config["bos_token"] if config["add_bos_token"] and config["bos_token"] is not None else None
    eos = config["eos_token"] if config["add_eos_token"] and config["eos_token"] is not None else None
    single = [p for p in (f"{bos}:0" if bos else None, "$A:0", f"{eos}:0" if eos else None) if p]
    pair = single + [p for p in (f"{bos}:1" if bos else None, "$B:1", f"{eos}:1" if eos else None) if p]
    special = [(t, ids[t]) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's map of bytes to printable characters (the alphabet byte-level BPE vocabularies are spelled in)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
