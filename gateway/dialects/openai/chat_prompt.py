"""What a chat prompt is rendered from: the messages, the tools the template may show, and the fields
that steer the template, as vLLM takes them in /v1/chat/completions and /tokenize:

    add_generation_prompt   true (default): the prompt ends with the assistant's turn opened
    continue_final_message  false (default); true: the prompt ends inside the final message, which the
                            model goes on writing (an answer begun by the client). Both true is a 400.
    chat_template_kwargs    more template variables, e.g. Qwen3's enable_thinking
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.http.errors import bad_request
from gateway.http.request_fields import Fields

# Variables the server sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)


def parse_chat_prompt(f: Fields, tools: list[dict] | None) -> ChatPrompt:
    """``tools``: the request's tools, already checked (tool_calls.parse_tools)."""
    messages = parse_messages(f.raw("messages"))
    add_generation_prompt = f.bool("add_generation_prompt", True)
    continue_final = f.bool("continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: the first "
            "continues the last message, the second opens a new one",
            "continue_final_message",
        )
    if continue_final and not isinstance(messages[-1].get("content"), str):
        raise bad_request(
            "continue_final_message needs a final message with text content to continue", "continue_final_message"
        )
    return ChatPrompt(
        messages, tools, add_generation_prompt, continue_final, _template_kwargs(f.raw("chat_template_kwargs"))
    )


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad_request(f"messages[{i}].content: only text content parts are supported", "messages")
            m = {**m, "content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(m)
    return out


def _template_kwargs(kwargs) -> dict:
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking): variables the template sees, beside
    the ones the server sets itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    taken = [k for k in RESERVED_TEMPLATE_VARIABLES if k in kwargs]
    if taken:
        raise bad_request(
            f"chat_template_kwargs must not set {taken[0]!r}; the request's own fields do", "chat_template_kwargs"
        )
    return kwargs
