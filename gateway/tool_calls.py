"""Forced tool calls in chat: ``tool_choice`` "required" or a named function, as vLLM serves them.

The output is generated under a structured output, so it always parses:

    named function f   the JSON schema of f's ``parameters``: the text IS the call's arguments
    "required"        a JSON array of one or more ``{"name": <a tool's name>, "parameters": {...}}``

and the response carries ``tool_calls`` instead of text (finish_reason "tool_calls" for "required";
"stop" for a named function, as OpenAI and vLLM answer a forced call). "auto" needs a model-specific
parser of free text, which this server does not have: a 400, as vLLM without ``--tool-call-parser``.
An output cut by max_tokens cannot be parsed: "required" then answers its text with finish_reason
"length"; a named call keeps its (partial) arguments, with "length".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from protocol.serving import StructuredOutput
from .errors import bad_request
from .request_fields import Fields


@dataclass(slots=True)
class ToolChoice:
    tools: list[dict]  # the request's tools, as sent (the chat template may show them to the model)
    name: str | None  # the named function; None: "required"

    def structured_output(self) -> StructuredOutput:
        if self.name is not None:
            return StructuredOutput("json", json.dumps(_parameters(self._tool(self.name)), ensure_ascii=False))
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))

    def calls(self, text: str, finish_reason: str | None) -> tuple[list[dict] | None, str | None]:
        """(tool_calls, finish_reason) of a finished choice; tool_calls None: answer the text instead."""
        if self.name is not None:
            return [_call(self.name, text)], finish_reason
        try:
            parsed = json.loads(text)
        except ValueError:
            return None, finish_reason  # cut by max_tokens
        return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed], "tool_calls"

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def parse_tool_choice(f: Fields) -> ToolChoice | None:
    """The chat request's forced tool call, or None (tools absent, or tool_choice "none")."""
    tools = f.raw("tools")
    if tools is not None and not (isinstance(tools, list) and tools and all(_is_tool(t) for t in tools)):
        raise bad_request("tools must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\": "
                          "string, \"parameters\": JSON schema object}}", "tools")
    choice = f.raw("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice other than 'none' needs tools", "tool_choice")
    if choice == "auto":
        raise bad_request("tool_choice 'auto' needs a parser of the model's free-form tool calls, which this "
                          "server does not have; use 'required' or name a function", "tool_choice")
    if choice == "required":
        return ToolChoice(tools, None)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names function {name[:60]!r}, which is not among the tools", "tool_choice")
    return ToolChoice(tools, name)


@dataclass(slots=True)
class ToolCallStream:
    """Chat stream deltas of forced tool calls: a named call streams its arguments as they come; the
    calls of "required" go out whole once the choice ends (the array parses only then)."""

    choice: ToolChoice
    _texts: dict[int, str] = field(default_factory=dict)  # choice index -> output so far
    _ids: dict[int, str] = field(default_factory=dict)  # choice index -> the named call's id

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the chunk's delta, its finish_reason) for new output ``text`` of choice ``index``."""
        if self.choice.name is not None:
            if not text:
                return {}, finish_reason
            if index in self._ids:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish_reason
            self._ids[index] = _call_id()
            return {"tool_calls": [{"index": 0, "id": self._ids[index], "type": "function",
                                    "function": {"name": self.choice.name, "arguments": text}}]}, finish_reason
        self._texts[index] = self._texts.get(index, "") + text
        if finish_reason is None:
            return {}, None
        whole = self._texts.pop(index)
        calls, finish_reason = self.choice.calls(whole, finish_reason)
        if calls is None:
            return {"content": whole}, finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, finish_reason


def _is_tool(t) -> bool:
    fn = t.get("function") if isinstance(t, dict) else None
    return (t.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and bool(fn["name"]) and isinstance(fn.get("parameters", {}), dict))


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
