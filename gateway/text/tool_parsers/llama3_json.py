"""llama3_json (Llama 3.1-3.3): the whole output is {"name": .., "parameters": {..}} (several joined by ";")."""

from __future__ import annotations

import json

from .base import Call, WholeOutputReader, call_of


class Llama3JsonReader(WholeOutputReader):
    TAGS, OPEN = ("<|python_tag|>",), "{"  # a special token: the detokenizer usually drops it already

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        return _parse_joined(text.lstrip().removeprefix(self.TAGS[0]))


def _parse_joined(text: str) -> list[Call] | None:
    """JSON call objects one after another, separated by ";" and space; None unless all of it is that."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
