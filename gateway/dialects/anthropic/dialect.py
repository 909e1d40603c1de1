"""Anthropic's Messages API as a dialect of the serving pipeline (gateway/serving/dialect.py): the chat
request it amounts to, answered as a Message (output.py), errors in Anthropic's shape."""

from __future__ import annotations

from gateway.serving.dialect import Asked, Dialect, OutputContext, ParseContext

from .output import MessageBuilder, anthropic_error
from .request import parse_messages


def _parse(body, ctx: ParseContext) -> Asked:
    def output(c: OutputContext) -> MessageBuilder:
        return MessageBuilder(c.rid, c.model, c.shape)

    return Asked(parse_messages(body, ctx.tool_call_parser), output)


MESSAGES = Dialect(
    "messages", "/v1/messages", "msg_", chat=True, parse=_parse, error_body=anthropic_error, key_in_x_api_key=True
)
