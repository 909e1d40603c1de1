"""What every tool-call reader is (``ToolCallParser``) and the pieces several of them share."""

from __future__ import annotations

import json
from typing import ClassVar, Protocol

Call = tuple[str, str]  # (function name, arguments as a JSON text)


class ToolCallParser(Protocol):
    """Reads the tool calls out of one choice's text as it streams (the gateway makes one per choice).

    ``feed(text, final)`` -> (content, calls): the text that is content after all, and the calls
    finished so far. Text that may still become a call is held back; what turns out not to be one goes
    out as content, so nothing is lost. ``final``: the choice ended, nothing more comes."""

    # Its markers are special tokens, which the detokenizer would otherwise drop (vLLM's mistral parser
    # turns skip_special_tokens off for the same reason): the request then keeps them in its text.
    reads_special_tokens: ClassVar[bool] = False

    __slots__ = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        """``tools``: the request's, in chat form (only readers whose values are untyped text read them)."""

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]: ...


def call_of(obj, arguments_keys: tuple[str, ...]) -> Call | None:
    """A call from a decoded {"name": str, <an arguments key>: object}; None if it is not one."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class SpaceAroundCalls(ToolCallParser):
    """The text outside the calls to pass on, for readers whose calls stand among text. The space around
    calls is not an answer: space at the end is held until more text comes, and dropped at the end
    where there were calls (the reader adds ``_gap`` to its last content where there were none)."""

    __slots__ = ("_gap",)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._gap = ""

    def _outside(self, text: str) -> str:
        self._gap += text
        ready = self._gap.rstrip()
        self._gap = self._gap[len(ready) :]
        return ready


class WholeOutputReader(ToolCallParser):
    """An output that is calls only as a whole: once it starts (after space) with one of ``TAGS`` or with
    ``OPEN`` it is held to the end and read by ``_parse``; anything else streams on as content at once."""

    TAGS: tuple[str, ...] = ()
    OPEN = ""

    __slots__ = ("_pending", "_state")

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._pending = ""
        self._state = "start"  # "start" (nothing but space yet) | "calls" | "content"

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending = self._pending + text
        if self._state == "start":
            lead = pending.lstrip()
            if lead.startswith((*self.TAGS, self.OPEN)):
                self._state = "calls"
            elif not final and (not lead or any(tag.startswith(lead) for tag in self.TAGS)):
                self._pending = pending
                return "", []
            else:
                self._state = "content"
        if self._state == "content":
            self._pending = ""
            return pending, []
        if not final:
            self._pending = pending
            return "", []
        self._pending = ""
        calls = self._parse(pending)
        return ("", calls) if calls else (pending, [])

    def _parse(self, text: str) -> list[Call] | None:
        raise NotImplementedError


def json_array(part: str) -> tuple[list[Call], str] | None:
    """A JSON array of {"name": .., "arguments": {..}} (mistral before tokenizer v11, granite), and the text
    after it."""
    part = part.lstrip()
    try:
        items, end = json.JSONDecoder().raw_decode(part)
    except (ValueError, RecursionError):
        return None
    calls = [call_of(item, ("arguments",)) for item in items] if isinstance(items, list) else []
    return (calls, part[end:]) if calls and None not in calls else None
