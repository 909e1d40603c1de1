"""Readers of a model's own tool calls in free text, for ``tool_choice: "auto"``, as vLLM's
``--tool-call-parser`` (``gateway.tool_call_parser``):

    hermes        Qwen2.5/Qwen3, Hermes: text, then <tool_call>{"name": .., "arguments": {..}}</tool_call> ...
    llama3_json   Llama 3.1-3.3: the whole output is {"name": .., "parameters": {..}} (several joined by ";")

Each reads one choice's text as it streams, ``feed(text, final)`` -> (content, calls), a call being a
finished (name, arguments JSON) pair. Text that may still become a call is held back; what turns out
not to be one (JSON that does not parse, or is not a call) goes out as content, so nothing is lost.
A hermes call goes out when its closing tag arrives, and the space around calls is dropped; a
llama3_json output, once it starts with "{", only at the end (it is a call only if the whole of it
parses).
"""

from __future__ import annotations

import json

from .stop_strings import cut_at

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
Call = tuple[str, str]  # (function name, arguments as a JSON text)


def _call(obj, arguments_keys: tuple[str, ...]) -> Call | None:
    """A call from a decoded {"name": str, <an arguments key>: object}; None if it is not one."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesReader:
    START, END = "<tool_call>", "</tool_call>"

    __slots__ = ("_pending", "_in_call", "_gap", "_has_calls")

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._gap = ""  # text outside the calls, held while it is only space
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
            call = _parse_one(body)
            if call is None:  # not a call: give the text back as it came
                content += self._outside(self.START + body + (self.END if closed else ""))
            else:
                calls.append(call)
                self._has_calls = True
            self._in_call, pending = False, rest
        self._pending = pending
        if final and not self._has_calls:
            content, self._gap = content + self._gap, ""
        return content, calls

    def _outside(self, text: str) -> str:
        """Text outside the calls to pass on. The space around calls is not an answer: space at the
        end is held until more text comes, and dropped at the end where there were calls."""
        self._gap += text
        ready = self._gap.rstrip()
        self._gap = self._gap[len(ready):]
        return ready


def _parse_one(body: str) -> Call | None:
    try:
        return _call(json.loads(body), ("arguments", "parameters"))
    except ValueError:
        return None


class Llama3JsonReader:
    PYTHON_TAG = "<|python_tag|>"  # a special token: the detokenizer usually drops it already

    __slots__ = ("_pending", "_state")

    def __init__(self) -> None:
        self._pending = ""
        self._state = "start"  # "start" (nothing but space yet) | "json" | "content"

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending = self._pending + text
        if self._state == "start":
            lead = pending.lstrip()
            if lead.startswith(self.PYTHON_TAG) or lead.startswith("{"):
                self._state = "json"
            elif not final and (not lead or self.PYTHON_TAG.startswith(lead)):
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
        calls = _parse_joined(pending.lstrip().removeprefix(self.PYTHON_TAG))
        return ("", calls) if calls else (pending, [])


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
        except ValueError:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


def make_reader(name: str) -> HermesReader | Llama3JsonReader:
    return {"hermes": HermesReader, "llama3_json": Llama3JsonReader}[name]()
