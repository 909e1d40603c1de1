"""Tool calls in chat, as vLLM serves them: forced (``tool_choice`` "required" or a named function) or
the model's own choice ("auto", where a parser of its free-form calls is configured).

A forced call is generated under a structured output, so it always parses:

    named function f   the JSON schema of f's ``parameters``: the text IS the call's arguments
    "required"        a JSON array of one or more ``{"name": <a tool's name>, "parameters": {...}}``

and the response carries ``tool_calls`` instead of text (finish_reason "tool_calls" for "required";
"stop" for a named function, as OpenAI and vLLM answer a forced call). "auto" generates freely and
reads the calls out of the text with ``gateway.tool_call_parser`` (gateway/text/tool_parsers/); without
one it is a 400, as in vLLM without ``--tool-call-parser``. ``parallel_tool_calls: false`` allows one
call: "required"'s grammar then takes an array of one, "auto" answers the first call it reads. An
output cut by max_tokens cannot be parsed: "required" then answers its text with finish_reason
"length"; a named call keeps its (partial) arguments, with "length".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from gateway.http.errors import bad_request
from gateway.http.request_fields import Fields
from protocol.serving import StructuredOutput

from .tool_parsers import make_reader


@dataclass(slots=True)
class ToolChoice:
    tools: list[dict]  # the request's tools, as sent (the chat template may show them to the model)
    name: str | None  # the named function; None: "required" or "auto"
    auto_parser: str | None = None  # "auto": the parser of the model's own calls
    parallel: bool = True  # parallel_tool_calls: False allows one call ("required": by the grammar; "auto": the first)

    def structured_output(self) -> StructuredOutput | None:
        if self.auto_parser is not None:
            return None
        if self.name is not None:
            return StructuredOutput("json", json.dumps(_parameters(self._tool(self.name)), ensure_ascii=False))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def parse_tool_choice(f: Fields, tools: list[dict] | None, auto_parser: str | None = None) -> ToolChoice | None:
    """The chat request's tool choice, or None (tools absent, or tool_choice "none"); ``tools``: the
    request's, checked by ``parse_tools``; ``auto_parser``: the configured reader of free-form calls,
    without which "auto" is refused."""
    parallel = f.bool("parallel_tool_calls", True)
    choice = f.raw("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice other than 'none' needs tools", "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise bad_request(
                "tool_choice 'auto' needs a parser of the model's free-form tool calls: start the "
                "server with --tool-call-parser (gateway.tool_call_parser), or use 'required' or "
                "name a function",
                "tool_choice",
            )
        return ToolChoice(tools, None, auto_parser, parallel)
    if choice == "required":
        return ToolChoice(tools, None, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names function {name[:60]!r}, which is not among the tools", "tool_choice")
    return ToolChoice(tools, name)


MAX_TOOLS = 128  # OpenAI's limit on one request's tools: every prompt renders all of them
MAX_TOOL_NAME_CHARS = 64  # OpenAI's limit on a function name


def parse_tools(tools) -> list[dict] | None:
    if tools is not None and not (isinstance(tools, list) and tools and all(_is_tool(t) for t in tools)):
        raise bad_request(
            'tools must be a non-empty list of {"type": "function", "function": {"name": '
            'string, "parameters": JSON schema object}}',
            "tools",
        )
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_request(f"tools may list at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    for i, tool in enumerate(tools or []):
        if len(tool["function"]["name"]) > MAX_TOOL_NAME_CHARS:
            raise bad_request(
                f"tools[{i}].function.name may have at most {MAX_TOOL_NAME_CHARS} characters, "
                f"got {len(tool['function']['name'])}",
                "tools",
            )
    return tools


class ToolCallReader:
    """One choice's text in, (content, OpenAI tool_call delta entries, finish_reason) out, as it streams:
    a named call streams its arguments as they come; the calls of "required" go out whole once the
    choice ends (the array parses only then); "auto" ones as its parser finds them."""

    __slots__ = ("_choice", "_text", "_named_id", "_free", "_num_calls")

    def __init__(self, choice: ToolChoice) -> None:
        self._choice = choice
        self._text = ""  # "required": the output so far
        self._named_id: str | None = None
        self._free = make_reader(choice.auto_parser, choice.tools) if choice.auto_parser is not None else None
        self._num_calls = 0

    def feed(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        final = finish_reason is not None
        if self._free is not None:
            content, calls = self._free.feed(text, final)
            entries = self._entries(calls)
            return content, entries, "tool_calls" if final and self._num_calls else finish_reason
        if self._choice.name is not None:
            if self._named_id is not None:
                return "", [{"index": 0, "function": {"arguments": text}}] if text else [], finish_reason
            if not (text or final):
                return "", [], None
            self._named_id, self._num_calls = _call_id(), 1
            return (
                "",
                [
                    {
                        "index": 0,
                        "id": self._named_id,
                        "type": "function",
                        "function": {"name": self._choice.name, "arguments": text},
                    }
                ],
                finish_reason,
            )
        self._text += text
        if not final:
            return "", [], None
        try:
            parsed = json.loads(self._text)
        except ValueError:
            return self._text, [], finish_reason  # cut by max_tokens
        calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed]
        return "", self._entries(calls), "tool_calls"

    def _entries(self, calls: list[tuple[str, str]]) -> list[dict]:
        if not self._choice.parallel:  # vLLM's parallel_tool_calls=false: the first call only
            calls = calls[: max(0, 1 - self._num_calls)]
        first, self._num_calls = self._num_calls, self._num_calls + len(calls)
        return [
            {
                "index": first + i,
                "id": _call_id(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for i, (name, arguments) in enumerate(calls)
        ]


def _is_tool(t) -> bool:
    fn = t.get("function") if isinstance(t, dict) else None
    return (
        t.get("type") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and bool(fn["name"])
        and isinstance(fn.get("parameters", {}), dict)
    )


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
