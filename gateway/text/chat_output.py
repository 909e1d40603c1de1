"""What a chat choice's generated text becomes in the response: reasoning, content and tool calls.

    text -> [reasoning split: <think>...</think>] -> content -> [tool calls read out of it] -> delta

Streamed, each piece of text becomes one delta (``ChatOutput.feed``); the whole answer is the same
reading of the whole text at once (``chat_message``), so the streamed deltas always add up to it.
The reasoning field goes out under both names clients read: ``reasoning`` (vLLM's, OpenAI's
guidance) and ``reasoning_content`` (DeepSeek's API, and what LiteLLM and many UIs look for).
"""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import PARSERS as REASONING_PARSERS
from .tool_calls import ToolCallReader, ToolChoice


@dataclass(slots=True, frozen=True)
class ChatParsers:
    """The server's readers of chat output (gateway.reasoning_parser, gateway.tool_call_parser); None: off."""

    reasoning: str | None = None  # gateway/text/reasoning/ PARSERS
    tool_calls: str | None = None  # gateway/text/tool_parsers/ PARSERS


@dataclass(slots=True, frozen=True)
class ChatShape:
    """How one chat request's output is read; the same for each of its choices."""

    reasoning: str | None = None  # the reasoning parser that splits the reasoning off (configured and asked for)
    opened_by_prompt: bool = False  # the prompt ends with <think>: the output starts inside the reasoning
    include_reasoning: bool = True  # False: the reasoning is split off and dropped (vLLM's include_reasoning)
    tool_choice: ToolChoice | None = None


class ChatOutput:
    """One choice: ``feed(text, finish_reason)`` -> (its delta, the finish_reason to report)."""

    __slots__ = ("_reasoning", "_include_reasoning", "_tools")

    def __init__(self, shape: ChatShape) -> None:
        self._include_reasoning = shape.include_reasoning
        self._reasoning = (
            REASONING_PARSERS[shape.reasoning](shape.opened_by_prompt) if shape.reasoning is not None else None
        )
        self._tools = ToolCallReader(shape.tool_choice) if shape.tool_choice is not None else None

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        final = finish_reason is not None
        reasoning, content = self._reasoning.feed(text, final) if self._reasoning is not None else ("", text)
        calls: list[dict] = []
        if self._tools is not None:
            content, calls, finish_reason = self._tools.feed(content, finish_reason)
        delta: dict = {}
        if reasoning and self._include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish_reason


def chat_message(shape: ChatShape, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, its finish_reason) of a finished choice's whole text."""
    delta, finish_reason = ChatOutput(shape).feed(text, finish_reason)
    calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls", ())]
    message = {"role": "assistant", "content": delta.get("content", None if calls or "reasoning" in delta else "")}
    if "reasoning" in delta:
        message["reasoning"] = message["reasoning_content"] = delta["reasoning"]
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason
