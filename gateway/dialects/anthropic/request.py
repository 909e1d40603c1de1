"""An Anthropic Messages API request (``POST /v1/messages``, as vLLM serves it) read as the chat request
it amounts to. Translated field by field, then checked by the chat parser itself, so this endpoint and
chat accept and refuse the same things:

    system               a system message first (a string, or text blocks joined)
    messages             user and assistant turns; content a string or blocks: text as it is, an
                         assistant's tool_use blocks its tool_calls (input as JSON arguments), a user's
                         tool_result blocks tool messages (before the turn's text, as Anthropic orders
                         them); thinking blocks are dropped (templates drop past reasoning)
    max_tokens           max_completion_tokens (required, as in Anthropic's API)
    stop_sequences       stop
    tools                {name, description, input_schema} -> chat's function tools
    tool_choice          auto -> "auto", any -> "required", tool -> that function, none -> "none";
                         disable_parallel_tool_use -> parallel_tool_calls false
    thinking             {"type": "enabled" | "disabled"} -> the template's enable_thinking (Qwen3's
                         switch), unless chat_template_kwargs set it
    output_config.format a json_schema -> response_format
    metadata.user_id     user
    temperature, top_p, top_k, stream, and vLLM's sampling extras: as they are

Refused with a 400 naming the field: image and document content, server tools (web search, bash, ...).
"""

from __future__ import annotations

import json

from gateway.dialects.openai.request import ParsedRequest, parse_chat
from gateway.dialects.responses.request import PASSED_THROUGH
from gateway.http.errors import APIError, bad_request
from gateway.http.request_fields import Fields

_PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def parse_messages(body, tool_call_parser: str | None = None) -> ParsedRequest:
    f = Fields(body)
    max_tokens = f.int("max_tokens", None, lo=1)
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    chat = {name: body[name] for name in PASSED_THROUGH if name in body and name not in ("stop", "user")}
    chat["max_completion_tokens"] = max_tokens
    chat["messages"] = _system(f.raw("system")) + _messages(f.raw("messages"))
    if f.has("stop_sequences"):
        chat["stop"] = f.raw("stop_sequences")
    tools = _tools(f.raw("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = f.object("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if choice.bool("disable_parallel_tool_use", False):
            chat["parallel_tool_calls"] = False
    thinking = f.object("thinking")
    if thinking is not None:
        kind = thinking.raw("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking")
        kwargs = dict(chat.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", kind != "disabled")
        chat["chat_template_kwargs"] = kwargs
    output = f.object("output_config")
    form = output.raw("format") if output is not None else None
    if form is not None:
        if not (isinstance(form, dict) and form.get("type") == "json_schema" and isinstance(form.get("schema"), dict)):
            raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    metadata = f.object("metadata")
    if metadata is not None and metadata.raw("user_id") is not None:
        chat["user"] = metadata.raw("user_id")
    try:
        return parse_chat(chat, tool_call_parser)
    except APIError as e:
        e.param = _PARAM_NAMES.get(e.param, e.param)
        raise


def _system(system) -> list[dict]:
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system", "system")}]


def _messages(given) -> list[dict]:
    if not isinstance(given, list) or not given:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    messages: list[dict] = []
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message["role"] == "assistant":
                calls.append(
                    {
                        "id": _string(block, "id", at),
                        "type": "function",
                        "function": {"name": _string(block, "name", at), "arguments": json.dumps(_input(block, at))},
                    }
                )
            elif kind == "tool_result" and message["role"] == "user":
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": _string(block, "tool_use_id", at),
                        "content": _text(block.get("content", ""), f"{at}.content", "messages"),
                    }
                )
            elif kind not in ("thinking", "redacted_thinking") or message["role"] != "assistant":
                raise bad_request(
                    f"{at}: content blocks of type {str(kind)[:40]!r} are not supported here (text; "
                    "tool_use and thinking from the assistant; tool_result from the user)",
                    "messages",
                )
        messages += results
        if calls:
            messages.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            messages.append({"role": message["role"], "content": "".join(texts)})
    return messages


def _text(content, where: str, param: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise bad_request(f"{where} must be a string or a list of text blocks; other content is not supported", param)


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string", "messages")
    return value


def _input(block: dict, where: str) -> dict:
    value = block.get("input", {})
    if not isinstance(value, dict):
        raise bad_request(f"{where}.input must be an object", "messages")
    return value


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(
                f"tools[{i}]: only client tools (name, input_schema) are supported, got type {str(kind)[:40]!r}",
                "tools",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        function = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice: Fields):
    kind = choice.raw("type")
    if kind in _CHOICES:
        return _CHOICES[kind]
    if kind == "tool" and isinstance(choice.raw("name"), str):
        return {"type": "function", "function": {"name": choice.raw("name")}}
    raise bad_request(
        'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}', "tool_choice"
    )
