"""A Responses API request (``POST /v1/responses``) read as the chat request it amounts to.

The conversation is ``input``, after the items of the stored chain ``previous_response_id`` names
(gateway/dialects/responses/store.py; a missing one is a 404, a background one still running a 400). Translated
field by field, then checked by the chat parser itself, so both endpoints accept and refuse the same
things:

    input                a string: one user message. A list of items: messages keep their role
                         (developer -> system, the role chat templates know) and text content;
                         function_call items become the assistant's tool_calls, function_call_output
                         items tool messages; reasoning items are dropped (templates drop past reasoning)
    instructions         a system message before the conversation (a previous response's are not
                         carried over, as in OpenAI's)
    store                keep the answer (the default) where the gateway's store is on
    background           answered at once, ``queued``; read back with GET (gateway/dialects/responses/background.py).
                         Needs the store, and is not streamed
    truncation           "auto": the earliest turns are dropped until the prompt fits the context
                         (gateway/dialects/responses/conversation_fit.py); "disabled" (the default): too long is a 400
    max_output_tokens    max_completion_tokens
    tools                flat function tools -> chat's {"type": "function", "function": {...}}
    tool_choice          the same choice; {"type": "function", "name": f} names f
    text.format          response_format (text, json_object, json_schema)
    top_logprobs         logprobs of the output text with that many alternatives (include
                         ["message.output_text.logprobs"] alone: without alternatives)
    temperature, top_p, parallel_tool_calls, stream, and vLLM's sampling extras: as they are

Refused with a 400 naming the field: conversation (no Conversations API), background without the store
or with stream, content other than text, tools other than functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.dialects.openai.request import MAX_LOGPROBS, ParsedRequest, parse_chat
from gateway.http.errors import APIError, bad_request
from gateway.http.request_fields import Fields

from .output import new_id
from .store import ResponseStore

# vLLM's sampling fields beyond OpenAI's, taken by /v1/responses as by chat.
PASSED_THROUGH = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "stream",
    "user",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_reasoning",
    "chat_template_kwargs",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "cache_salt",
)
# A chat field an error names -> the Responses field the client sent.
_PARAM_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "logprobs": "top_logprobs",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value that changes what is generated
MAX_METADATA_PAIRS = 16  # OpenAI's limits
MAX_METADATA_VALUE_CHARS = 512
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


_ITEM_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


@dataclass(slots=True)
class ResponsesRequest:
    parsed: ParsedRequest  # the chat request it amounts to
    echo: dict  # the request's settings, as a Response object repeats them
    input_items: list[dict]  # its own input as items with ids (what the store lists for it)
    store: bool  # keep the answer
    truncate: bool = False  # truncation "auto"
    background: bool = False  # answered at once; the generation goes on in the gateway


def parse_responses(body, tool_call_parser: str | None = None, store: ResponseStore | None = None) -> ResponsesRequest:
    f = Fields(body)
    if f.has("conversation"):
        raise bad_request(
            "conversation is not supported: this server has no Conversations API (send the "
            "conversation in input, or go on from a stored response with previous_response_id)",
            "conversation",
        )
    keep = f.bool("store", True) and store is not None and store.enabled
    background = f.bool("background", False)
    if background and not keep:
        why = (
            "store is false"
            if store is not None and store.enabled
            else "this server stores no responses (gateway.responses_store_mb is 0)"
        )
        raise bad_request(f"background responses are read back from the store, but {why}", "background")
    if background and f.bool("stream", False):
        raise bad_request("background responses are not streamed here: poll GET /v1/responses/{id} instead", "stream")
    previous_id = f.str("previous_response_id", None)
    earlier = _earlier_items(previous_id, store) if previous_id is not None else []
    truncation = f.raw("truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise bad_request("truncation must be 'auto' or 'disabled'", "truncation")
    max_output_tokens = f.int("max_output_tokens", None, lo=1)
    top_logprobs = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is None and LOGPROBS_INCLUDE in _include(f.raw("include")):
        top_logprobs = 0  # the sampled tokens' logprobs, no alternatives
    tools = _tools(f.raw("tools"))
    tool_choice = _tool_choice(f.raw("tool_choice"))
    text_format = _text_format(f.object("text"))
    chat = {name: body[name] for name in PASSED_THROUGH if name in body}
    own = _messages(f.raw("input"))  # checked alone first, so that its errors name its own items
    items = _as_items(f.raw("input"))
    chat["messages"] = _instructions(f.str("instructions", None)) + (_messages(earlier + items) if earlier else own)
    if max_output_tokens is not None:
        chat["max_completion_tokens"] = max_output_tokens
    if top_logprobs is not None:
        chat.update(logprobs=True, top_logprobs=top_logprobs)
    if tools is not None:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if text_format["type"] == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        parsed = parse_chat(chat, tool_call_parser)
    except APIError as e:
        e.param = _PARAM_NAMES.get(e.param, e.param)
        raise
    echo = {
        "instructions": f.str("instructions", None),
        "max_output_tokens": max_output_tokens,
        "metadata": _metadata(f.raw("metadata")),
        "parallel_tool_calls": f.bool("parallel_tool_calls", True),
        "temperature": f.raw("temperature", 1.0),
        "top_p": f.raw("top_p", 1.0),
        "top_logprobs": top_logprobs,
        "tool_choice": f.raw("tool_choice", "auto"),
        "tools": tools or [],
        "text": {"format": text_format},
        "user": parsed.user,
        "reasoning": f.raw("reasoning"),
        "previous_response_id": previous_id,
        "store": keep,
        "truncation": truncation,
        "background": background,
    }
    return ResponsesRequest(parsed, echo, items, keep, truncation == "auto", background)


def _earlier_items(previous_id: str, store: ResponseStore | None) -> list[dict]:
    if store is None or not store.enabled:
        raise bad_request(
            "previous_response_id needs the response store, which is off on this server "
            "(gateway.responses_store_mb is 0): send the whole conversation in input",
            "previous_response_id",
        )
    previous = store.get(previous_id)
    if previous is not None and previous.body["status"] in ("queued", "in_progress"):  # a background one
        raise bad_request(
            f"Previous response {previous_id[:100]!r} is still {previous.body['status']}: go on "
            "from it once it has ended (GET /v1/responses/{id} shows its status)",
            "previous_response_id",
        )
    earlier = store.conversation(previous_id)
    if isinstance(earlier, str):
        gone = "" if earlier == previous_id else f" (an earlier response of its chain, {earlier[:100]!r}, is not)"
        raise APIError(
            404,
            f"Previous response with id {previous_id[:100]!r} not found{gone}: responses are kept "
            "in the memory of the gateway that answered them, the least recently used "
            "dropped first",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return earlier


def _as_items(given) -> list[dict]:
    """The input (already checked) as OpenAI's item objects, as the store lists them and a continuation
    reads them back: a string is one user message, text content a list of parts, each item has an id and
    a status, and nothing the client added beyond the item's own fields is kept."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        done = {
            "id": item["id"] if isinstance(item.get("id"), str) else new_id(_ITEM_PREFIXES[kind]),
            "type": kind,
            "status": "completed",
        }
        if kind == "message":
            done["role"] = item["role"]
            texts = [item["content"]] if isinstance(item["content"], str) else [p["text"] for p in item["content"]]
            done["content"] = (
                [{"type": "output_text", "text": t, "annotations": []} for t in texts]
                if item["role"] == "assistant"
                else [{"type": "input_text", "text": t} for t in texts]
            )
        elif kind == "function_call":
            done.update(call_id=item["call_id"], name=item["name"], arguments=item["arguments"])
        elif kind == "function_call_output":
            done.update(call_id=item["call_id"], output=_text(item["output"], "output"))
        else:  # reasoning: its text parts, where given as such
            done.update(
                summary=_parts(item.get("summary"), "summary_text"),
                content=_parts(item.get("content"), "reasoning_text"),
            )
        items.append(done)
    return items


def _parts(given, kind: str) -> list[dict]:
    parts = given if isinstance(given, list) else []
    return [{"type": kind, "text": p["text"]} for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]


def _include(include) -> list[str]:
    """OpenAI's ``include``: extra output to return. Only the output text's logprobs change anything here;
    the rest name stored or tool outputs this server does not have, so asking for them returns nothing more."""
    if include is None:
        return []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("include must be a list of strings", "include")
    return include


def _instructions(text: str | None) -> list[dict]:
    return [{"role": "system", "content": text}] if text else []


def _messages(given) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    messages: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", "input")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            previous = messages[-1] if messages else {}
            if previous.get("role") == "assistant" and previous.get("tool_calls") and not previous.get("content"):
                previous["tool_calls"].append(call)  # calls made together are one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind != "reasoning":
            raise bad_request(
                f"{where}: input items of type {str(kind)[:40]!r} are not supported (message, "
                "function_call, function_call_output and reasoning are)",
                "input",
            )
    if not messages:
        raise bad_request("input holds no message", "input")
    return messages


def _text(content, where: str) -> str:
    """A string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request(
        f"{where} must be a string or a list of text parts (input_text, output_text); other content is not supported",
        "input",
    )


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string", "input")
    return value


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are supported, got type {str(kind)[:40]!r}", "tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
        if not isinstance(t.get("parameters") or {}, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", "tools")
        out.append(
            {
                "type": "function",
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict"),
            }
        )
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # "none", "auto", "required"; anything else the chat parser refuses
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}", "tool_choice"
    )


def _text_format(text: Fields | None) -> dict:
    given = text.raw("format") if text is not None else None
    if given is None:
        return {"type": "text"}
    kind = given.get("type") if isinstance(given, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format must be an object of type 'text', 'json_object' or 'json_schema'", "text.format")
    if kind == "json_schema" and given.get("schema") is None:
        raise bad_request("text.format of type 'json_schema' needs a schema", "text.format")
    return given


def _metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_PAIRS
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS
            for k, v in metadata.items()
        )
    ):
        raise bad_request(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values (keys up to 64 "
            f"characters, values up to {MAX_METADATA_VALUE_CHARS})",
            "metadata",
        )
    return metadata
