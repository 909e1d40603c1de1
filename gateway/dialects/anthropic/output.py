"""An Anthropic Messages API answer: the Message object and, streamed, the events that build it.

The generated text is read as chat reads it (``ChatOutput``: reasoning, content, tool calls), and each
piece becomes a content block, in order:

    reasoning   {"type": "thinking", "thinking", "signature": ""}   (nothing signs it here)
    content     {"type": "text", "text"}
    a tool call {"type": "tool_use", "id", "name", "input"}

Streamed: message_start; per block content_block_start, its deltas (text_delta, thinking_delta,
input_json_delta) and content_block_stop; then message_delta (stop_reason, output tokens) and
message_stop. A failure mid-stream is an ``error`` event. stop_reason: end_turn, max_tokens,
stop_sequence (with the one that matched) or tool_use. Usage: input_tokens is the prompt's tokens not
found in the prefix cache, cache_read_input_tokens those found, as Anthropic counts them.
The whole answer is the same reading of the whole text as one delta, so both forms always agree.
"""

from __future__ import annotations

import json

from gateway.http.errors import APIError
from gateway.http.sse import sse_named_event
from gateway.serving.choice import ChoiceDelta, ChoiceState
from gateway.text.chat_output import ChatOutput, ChatShape


def anthropic_error(e: APIError) -> dict:
    """The error body Anthropic's clients read: {"type": "error", "error": {"type", "message"}}."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
    }
    return {"type": "error", "error": {"type": kinds.get(e.status, "api_error"), "message": e.message}}


class MessageBuilder:
    """One message (n is always 1). Streamed: ``opening``, ``frames`` per delta, then ``closing`` or
    ``failure``, each the SSE frames of its events; whole: ``whole``."""

    def __init__(self, rid: str, model: str, shape: ChatShape) -> None:
        self._head = {"id": rid, "type": "message", "role": "assistant", "model": model}
        self._chat = ChatOutput(shape)
        self._blocks: list[dict] = []
        self._open: dict | None = None  # the block being written (always the last one)
        self._calls: dict[int, dict] = {}  # a tool call's index in the chat delta -> its block
        self._arguments: dict[int, str] = {}  # a tool_use block's index -> its arguments' JSON so far
        self._finish_reason: str | None = None

    def body(self, state: ChoiceState, stop_reason: str | None = None, stop_sequence: str | None = None) -> dict:
        return {
            **self._head,
            "content": [dict(b) for b in self._blocks],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(state),
        }

    def whole(self, states: list[ChoiceState]) -> dict:
        """The finished message of a non-streamed request."""
        state = states[0]  # n is always 1
        self._feed(ChoiceDelta(state.text, state.logprobs, state.finish_reason))
        self._close()
        return self.body(state, *self._stop(state))

    # ---- the stream (serving's StreamBuilder: each returns SSE frames) ----
    def opening(self, states: list[ChoiceState]) -> list[bytes]:
        start = {**self.body(states[0]), "content": []}
        start["usage"]["output_tokens"] = 0
        return _framed([{"type": "message_start", "message": start}])

    def frames(self, state: ChoiceState, d: ChoiceDelta) -> list[bytes]:
        return _framed(self._feed(d))

    def closing(self, states: list[ChoiceState]) -> list[bytes]:
        stop_reason, stop_sequence = self._stop(states[0])
        return _framed(
            self._close()
            + [
                # usage counts here are totals: the cached count is known only now, not at message_start
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": _usage(states[0]),
                },
                {"type": "message_stop"},
            ]
        )

    def failure(self, e: APIError) -> list[bytes]:
        return _framed([anthropic_error(e)])

    # ---- content blocks ----
    def _feed(self, d: ChoiceDelta) -> list[dict]:
        delta, self._finish_reason = self._chat.feed(d.text, d.finish_reason)
        events = []
        if "reasoning" in delta:
            events += self._write("thinking", delta["reasoning"])
        if "content" in delta:
            events += self._write("text", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def _stop(self, state: ChoiceState) -> tuple[str, str | None]:
        """Anthropic's stop_reason: a call made is tool_use, even a forced one (chat calls that "stop")."""
        if self._finish_reason == "length":
            return "max_tokens", None
        if isinstance(state.stop_reason, str):  # a stop string, not a stop token id
            return "stop_sequence", state.stop_reason
        return "tool_use" if self._calls else "end_turn", None

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._add(
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
        self._open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}]

    def _call(self, entry: dict) -> list[dict]:
        events = []
        if "id" in entry:  # a new call: its name, and maybe all of its arguments
            events += self._close()
            events += self._add({"type": "tool_use", "id": entry["id"], "name": entry["function"]["name"], "input": {}})
            self._calls[entry["index"]] = self._open
            self._arguments[len(self._blocks) - 1] = ""
        index = self._blocks.index(self._calls[entry["index"]])
        piece = entry["function"].get("arguments") or ""
        if piece:
            self._arguments[index] += piece
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": piece},
                }
            )
        return events

    def _add(self, block: dict) -> list[dict]:
        self._blocks.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self._blocks) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = self._blocks.index(block)
        if block["type"] == "tool_use":
            block["input"] = _arguments(self._arguments[index])
        return [{"type": "content_block_stop", "index": index}]


def _arguments(text: str) -> dict:
    """A call's arguments as the object Anthropic's input is: the tool parsers and the grammar of a
    forced call only give JSON objects; anything else is kept whole under one key."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def _usage(state: ChoiceState) -> dict:
    cached = state.num_cached_tokens
    return {
        "input_tokens": state.num_prompt_tokens - cached,
        "output_tokens": state.num_output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _framed(events: list[dict]) -> list[bytes]:
    return [sse_named_event(e["type"], e) for e in events]
