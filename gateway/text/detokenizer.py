"""Incremental detokenization: turn a growing list of token ids into text deltas, never broken UTF-8.

A byte-level token can hold half of a multi-byte character; decoding it alone gives U+FFFD. We decode a
short window and emit only once the window's text no longer ends in U+FFFD:

    ids:   [ ... context ... | prefix_offset ... read_offset | new ids ... ]
                               \\_ already emitted _________/ \\_ pending _/

Decoding from ``prefix_offset`` (a few ids of context, not just the new ones) keeps decoders that strip or
add a leading space per word (SentencePiece Metaspace) giving the same text as decoding the whole list.
"""

from __future__ import annotations

from .tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt ids kept as left context for the first generated token
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feeds on generated ids; ``add`` returns the new complete text, ``flush`` whatever is left."""

    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset", "_skip_special")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip_special = skip_special_tokens

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int], stopped: bool = False) -> str:
        """``stopped``: the last id is the stop token that ended generation. Where special tokens are kept,
        that EOS is still not text, as in vLLM (skipped, it decodes to nothing anyway)."""
        if stopped and token_ids and not self._skip_special and self._tok.is_special(token_ids[-1]):
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or a character still waits for its remaining bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of generation: the held-back tail, U+FFFD included if bytes never completed."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
