"""hermes (Qwen2.5/Qwen3, Hermes): text, then <tool_call>{"name": .., "arguments": {..}}</tool_call> ..."""

from __future__ import annotations

import json

from gateway.text.stop_strings import cut_at

from .base import Call, SpaceAroundCalls, call_of


class HermesReader(SpaceAroundCalls):
    START, END = "<tool_call>", "</tool_call>"

    __slots__ = ("_pending", "_in_call", "_has_calls")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._pending = ""
        self._in_call = False
        self._has_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending, self._pending = self._pending + text, ""
        content, calls = "", []
        while pending or self._in_call:
            if not self._in_call:
                head, pending, found = cut_at(pending, self.START, final)
                content += self._outside(head)
                if not found:
                    break
                self._in_call = True
                continue
            body, rest, closed = cut_at(pending, self.END, final)
            if not (closed or final):
                pending = body + rest  # the call is still coming
                break
            read = self._parse(body, closed)
            if not read:  # not a call: give the text back as it came
                content += self._outside(self.START + body + (self.END if closed else ""))
            else:
                calls += read
                self._has_calls = True
            self._in_call, pending = False, rest
        self._pending = pending
        if final and not self._has_calls:
            content, self._gap = content + self._gap, ""
        return content, calls

    def _parse(self, body: str, closed: bool) -> list[Call]:
        """The calls in the text between the tags (``closed``: the closing tag came); none: not a call."""
        call = _parse_one(body)
        return [] if call is None else [call]


def _parse_one(body: str) -> Call | None:
    try:
        return call_of(json.loads(body), ("arguments", "parameters"))
    except (ValueError, RecursionError):  # RecursionError: nested past what json decodes
        return None
