"""A Responses API answer: the Response object and, streamed, the events that build it.

The generated text is read as chat reads it (``ChatOutput``: reasoning, content, tool calls), and each
piece goes into an output item, in order:

    reasoning   {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}]}
    content     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text", "logprobs"}]}
    a tool call {"type": "function_call", "call_id", "name", "arguments"}

Streamed: response.created and response.in_progress; per item output_item.added, its content part
added, deltas (output_text / reasoning_text / function_call_arguments), their done events and
output_item.done; then response.completed, or response.incomplete when max_output_tokens cut it
(``incomplete_details.reason``). A failure mid-stream is an ``error`` event and response.failed.
The whole answer is the same reading of the whole text as one delta, so both forms always agree.
Whichever way it ends (completed, incomplete or failed), the finished Response goes to ``on_done``:
the store keeps it there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from gateway.dialects.openai.output import LogprobFormatter, usage
from gateway.http.errors import APIError
from gateway.http.sse import sse_named_event
from gateway.serving.choice import ChoiceDelta, ChoiceState
from gateway.text.chat_output import ChatOutput, ChatShape
from gateway.text.tokenizer import Tokenizer

_PREFIXES = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseBuilder:
    """One response (n is always 1). Streamed: ``opening``, ``frames`` per delta, then ``closing`` or
    ``failure``, each the SSE frames of its events; whole: ``whole``."""

    def __init__(
        self,
        rid: str,
        model: str,
        echo: dict,
        shape: ChatShape,
        fmt: LogprobFormatter,
        tokenizer: Tokenizer,
        on_done: Callable[[dict], object] | None = None,
    ) -> None:
        self._on_done = on_done
        self._head = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, **echo}
        self._chat = ChatOutput(shape)
        self._fmt = fmt
        self._tok = tokenizer
        self._wants_logprobs = echo.get("top_logprobs") is not None
        self._items: list[dict] = []
        self._open: dict | None = None  # the item being written (always the last one)
        self._calls: dict[int, dict] = {}  # a tool call's index in the chat delta -> its item
        self._status = "in_progress"
        self._finish_reason: str | None = None
        self._error: dict | None = None
        self._usage: dict | None = None
        self._seq = 0

    # ---- the Response object ----
    def body(self) -> dict:
        incomplete = {"reason": "max_output_tokens"} if self._status == "incomplete" else None
        return {
            **self._head,
            "status": self._status,
            "error": self._error,
            "incomplete_details": incomplete,
            "output": [dict(item) for item in self._items],
            "usage": self._usage,
        }

    def whole(self, states: list[ChoiceState]) -> dict:
        """The finished response of a non-streamed request."""
        state = states[0]  # n is always 1
        self._feed(ChoiceDelta(state.text, state.logprobs, state.finish_reason))
        self._finish(state)
        return self.body()

    # ---- the stream (serving's StreamBuilder: each returns SSE frames) ----
    def opening(self, states: list[ChoiceState]) -> list[bytes]:
        return _framed(self._start())

    def frames(self, state: ChoiceState, d: ChoiceDelta) -> list[bytes]:
        return _framed(self._feed(d))

    def closing(self, states: list[ChoiceState]) -> list[bytes]:
        return _framed(self._finish(states[0]))

    def failure(self, e: APIError) -> list[bytes]:
        return _framed(self._fail(e))

    # ---- events ----
    def _start(self) -> list[dict]:
        return [
            self._event("response.created", response=self.body()),
            self._event("response.in_progress", response=self.body()),
        ]

    def _feed(self, d: ChoiceDelta) -> list[dict]:
        delta, finish_reason = self._chat.feed(d.text, d.finish_reason)
        self._finish_reason = finish_reason
        events = []
        if "reasoning" in delta:
            events += self._write("reasoning", delta["reasoning"])
        if "content" in delta:
            logprobs = self._fmt.chat(d.logprobs)["content"] if self._wants_logprobs else []
            events += self._write("message", delta["content"], logprobs)
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def _finish(self, state: ChoiceState) -> list[dict]:
        self._status = "incomplete" if self._finish_reason == "length" else "completed"
        events = [] if self._items else self._add("message")  # nothing generated: an empty answer, still one
        events += self._close(self._status)
        counts = usage([state], 1)
        reasoning = "".join(c["text"] for item in self._items if item["type"] == "reasoning" for c in item["content"])
        prompt, cached = counts["prompt_tokens"], counts["prompt_tokens_details"]["cached_tokens"]
        self._usage = {
            "input_tokens": prompt,
            "output_tokens": counts["completion_tokens"],
            "total_tokens": counts["total_tokens"],
            # Every prompt token not found in the prefix cache was computed and written to it.
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
            # The reasoning's text re-encoded: its tokens as generated, up to how the boundary merges.
            "output_tokens_details": {
                "reasoning_tokens": len(self._tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            },
        }
        return events + [self._event(f"response.{self._status}", response=self._done())]

    def _fail(self, e: APIError) -> list[dict]:
        # response.error.code is one of OpenAI's fixed codes; the error event carries the specific one
        code = "invalid_prompt" if e.status < 500 else "server_error"
        self._status, self._error = "failed", {"code": code, "message": e.message}
        return [
            self._event("error", code=e.code, message=e.message, param=e.param),
            self._event("response.failed", response=self._done()),
        ]

    def _done(self) -> dict:
        body = self.body()
        if self._on_done is not None:
            self._on_done(body)
        return body

    # ---- output items ----
    def _write(self, kind: str, text: str, logprobs: list[dict] = ()) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._add(kind)
        item, index = self._open, len(self._items) - 1
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "message":
            part["logprobs"] += logprobs
            return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=list(logprobs))]
        return events + [self._event("response.reasoning_text.delta", **where, delta=text)]

    def _call(self, entry: dict) -> list[dict]:
        events = []
        if "id" in entry:  # a new call: its name, and maybe all of its arguments
            events += self._close("completed")
            events += self._add("function_call", call_id=entry["id"], name=entry["function"]["name"])
            self._calls[entry["index"]] = self._open
        item = self._calls[entry["index"]]
        piece = entry["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._items.index(item),
                    delta=piece,
                )
            )
        return events

    def _add(self, kind: str, **fields) -> list[dict]:
        item = {"id": new_id(_PREFIXES[kind]), "type": kind, "status": "in_progress"}
        if kind == "message":
            item.update(role="assistant", content=[])
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "reasoning":
            item.update(summary=[], content=[])
            part = {"type": "reasoning_text", "text": ""}
        else:
            item.update(arguments="", **fields)
            part = None
        self._items.append(item)
        self._open = item
        index = len(self._items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        if part is not None:
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self._items) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [
                self._event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            ]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events = [
                self._event(done, **where, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", **where, content_index=0, part=dict(part)),
            ]
        return events + [self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event


def _framed(events: list[dict]) -> list[bytes]:
    return [sse_named_event(e["type"], e) for e in events]


def _copy(item: dict) -> dict:
    """The item as it stands now (its parts copied: they grow after the event went out)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
