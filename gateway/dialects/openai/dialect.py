"""OpenAI's completions and chat completions as dialects of the serving pipeline (gateway/serving/dialect.py)."""

from __future__ import annotations

from gateway.http.errors import APIError
from gateway.serving.dialect import Asked, Dialect, OutputContext, ParseContext

from .output import ChunkBuilder
from .request import ParsedRequest, parse_chat, parse_completion


def _asked(p: ParsedRequest, chat: bool) -> Asked:
    def output(c: OutputContext) -> ChunkBuilder:
        return ChunkBuilder(
            c.rid, c.created, c.model, chat, c.fmt, c.opts, c.num_choices, p.include_usage, p.continuous_usage
        )

    return Asked(p, output)


def _parse_completion(body, ctx: ParseContext) -> Asked:
    return _asked(parse_completion(body), chat=False)


def _parse_chat(body, ctx: ParseContext) -> Asked:
    return _asked(parse_chat(body, ctx.tool_call_parser), chat=True)


COMPLETIONS = Dialect(
    "completions", "/v1/completions", "cmpl-", chat=False, parse=_parse_completion, error_body=APIError.body
)
CHAT = Dialect("chat", "/v1/chat/completions", "chatcmpl-", chat=True, parse=_parse_chat, error_body=APIError.body)
