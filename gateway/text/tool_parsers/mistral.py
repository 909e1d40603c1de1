"""mistral (Mistral): text, then [TOOL_CALLS][{"name": .., "arguments": {..}}, ..] (tokenizers before v11)
or [TOOL_CALLS]f{..}[TOOL_CALLS]g{..} (v11 on; [CALL_ID]id and [ARGS] may stand before {..})."""

from __future__ import annotations

import json
import re

from gateway.text.stop_strings import cut_at

from .base import Call, SpaceAroundCalls, json_array


class MistralReader(SpaceAroundCalls):
    MARKER = "[TOOL_CALLS]"
    reads_special_tokens = True

    __slots__ = ("_pending", "_in_calls")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._pending = ""
        self._in_calls = False  # past the first [TOOL_CALLS]: the rest is held to the end

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending, self._pending = self._pending + text, ""
        content, calls = "", []
        if not self._in_calls:
            head, pending, self._in_calls = cut_at(pending, self.MARKER, final)
            content += self._outside(head)
        if not (self._in_calls and final):
            self._pending = pending  # a possible start of the marker, or the calls still coming
        else:
            read = _parse_mistral(pending)
            if read is None:  # not calls: give the text back as it came
                content += self._outside(self.MARKER + pending)
            else:
                calls, after = read
                content += self._outside(after)
        if final and not calls:
            content, self._gap = content + self._gap, ""
        return content, calls


def _parse_mistral(text: str) -> tuple[list[Call], str] | None:
    """The calls after the first [TOOL_CALLS] and the text after the last of them; None unless each
    [TOOL_CALLS] is followed by calls, with only space between."""
    calls: list[Call] = []
    after = ""
    for part in text.split(MistralReader.MARKER):
        if after.strip():  # text between calls: not the format
            return None
        read = json_array(part) if part.lstrip().startswith("[") else _mistral_named(part)
        if read is None:
            return None
        calls += read[0]
        after = read[1]
    return calls, after


# v11 on: the name, then the arguments object; where the tokenizer's control tokens are kept in the text,
# [CALL_ID] and the call's id (ours are made by the gateway) and [ARGS] stand between them
_NAMED_CALL = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\]\s*)?(?=\{)")


def _mistral_named(part: str) -> tuple[list[Call], str] | None:
    """Tokenizers v11 on: ``name{..}``, and the text after it."""
    match = _NAMED_CALL.match(part)
    if match is None:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(part, match.end())
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return [(match[1], json.dumps(arguments, ensure_ascii=False))], part[end:]
