"""The dialect record: what sets one API dialect apart in the serving pipeline (pipeline.py), which is
otherwise the same for all of them (parse -> tokenize -> admit -> generate -> JSON or SSE).

    COMPLETIONS, CHAT   gateway/dialects/openai/dialect.py      /v1/completions, /v1/chat/completions
    RESPONSES           gateway/dialects/responses/dialect.py   /v1/responses
    MESSAGES            gateway/dialects/anthropic/dialect.py   /v1/messages

A dialect reads a body into an ``Asked`` (the completion or chat request it amounts to, and how to answer
it), and answers through an ``OutputBuilder``: the whole body, or the frames of its event stream.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.dialects.openai.output import LogprobFormatter, ResponseOptions
from gateway.dialects.openai.request import ParsedRequest
from gateway.dialects.responses.store import ResponseStore
from gateway.http.errors import APIError
from gateway.text.chat_output import ChatShape
from gateway.text.tokenizer import Tokenizer

from .choice import ChoiceDelta, ChoiceState

log = logging.getLogger("pdserve.gateway")


class StreamBuilder(Protocol):
    """One response's event stream: each call returns the SSE frames to send. ``opening`` before the
    first delta, ``frames`` per delta of a choice, then ``closing`` once every choice finished, or
    ``failure`` (the headers are gone by then: the only way left to tell the client is in-band)."""

    def opening(self, states: list[ChoiceState]) -> list[bytes]: ...

    def frames(self, state: ChoiceState, delta: ChoiceDelta) -> list[bytes]: ...

    def closing(self, states: list[ChoiceState]) -> list[bytes]: ...

    def failure(self, e: APIError) -> list[bytes]: ...


class OutputBuilder(StreamBuilder, Protocol):
    """One response in its dialect: streamed (``StreamBuilder``), or whole once every choice finished."""

    def whole(self, states: list[ChoiceState]) -> dict: ...


class StoredOutput(OutputBuilder, Protocol):
    """The output of a background response (the Responses API's): also its body as it stands at any
    time, stored queued and in progress before it ends."""

    def body(self) -> dict: ...


@dataclass(frozen=True, slots=True)
class ParseContext:
    """What a dialect's parser may consult besides the body."""

    tool_call_parser: str | None  # gateway.tool_call_parser: tool_choice "auto" needs one
    store: ResponseStore  # the Responses API's: previous_response_id reads it


@dataclass(frozen=True, slots=True)
class OutputContext:
    """What an output builder is made from, fixed once the request is tokenized."""

    rid: str  # the response's id
    created: int  # unix time of the answer
    model: str
    num_choices: int
    shape: ChatShape  # chat: how the text is read into reasoning, content and tool calls
    fmt: LogprobFormatter
    opts: ResponseOptions
    tokenizer: Tokenizer


@dataclass(slots=True)
class Asked:
    """What one request asks, whatever its dialect."""

    parsed: ParsedRequest  # the completion or chat request it amounts to
    output: Callable[[OutputContext], OutputBuilder]  # its answer, in its dialect
    fit: bool = False  # drop the earliest turns until the prompt fits the context (Responses' truncation "auto")
    # Answer at once with the response queued, and generate on without the client (the Responses API's
    # background mode); ``keep`` stores each state of the response (queued, in progress, cancelled).
    background: bool = False
    keep: Callable[[dict], object] | None = None


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API dialect, as the pipeline and the app's routes see it."""

    name: str  # "completions", "chat", "responses", "messages"
    path: str  # its route; every path under it answers errors in its shape
    id_prefix: str  # of its response ids: "cmpl-", "chatcmpl-", "resp_", "msg_"
    chat: bool  # the prompt is a conversation, rendered by the chat template
    parse: Callable[[object, ParseContext], Asked]  # a request body -> what it asks (400 naming the field)
    error_body: Callable[[APIError], dict]  # the error JSON its clients read
    keeps_request_id: bool = True  # its response ids carry the client's X-Request-Id
    # Its ids read stored data back (GET /v1/responses/{id}): only the gateway logs them, for the owner's
    # audit; the workers and every span see an internal id that opens nothing.
    private_ids: bool = False
    key_in_x_api_key: bool = False  # its clients send the API key bare in x-api-key (Bearer works too)

    def worker_rid(self, rid: str, given: str | None) -> str:
        """The id the workers serve response ``rid`` under (and log, and trace); ``given``: X-Request-Id."""
        if self.private_ids:
            # A stored response's id is how its owner reads it back: workers and spans never see it. This
            # line is the one place that ties the two together (the owner's audit, on the gateway only).
            internal = f"req-{uuid.uuid4().hex}"
            log.info("rid=%s serves %s", internal, rid)
            return internal
        # a client's id may be reused, so the workers' ids get a nonce of their own
        return f"{rid}-{uuid.uuid4().hex[:8]}" if given else rid
