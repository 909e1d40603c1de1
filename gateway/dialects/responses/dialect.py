"""OpenAI's Responses API as a dialect of the serving pipeline (gateway/serving/dialect.py): the chat
request it amounts to, answered as a Response (output.py), kept in the store where asked."""

from __future__ import annotations

from gateway.http.errors import APIError
from gateway.serving.dialect import Asked, Dialect, OutputContext, ParseContext

from .output import ResponseBuilder
from .request import parse_responses


def _parse(body, ctx: ParseContext) -> Asked:
    asked = parse_responses(body, ctx.tool_call_parser, ctx.store)
    keep = (lambda response: ctx.store.put(response, asked.input_items)) if asked.store else None

    def output(c: OutputContext) -> ResponseBuilder:
        return ResponseBuilder(c.rid, c.model, asked.echo, c.shape, c.fmt, c.tokenizer, keep)

    return Asked(asked.parsed, output, fit=asked.truncate, background=asked.background, keep=keep)


# Its ids are the server's (resp_...), never the client's X-Request-Id: the store is keyed by them, so they
# stay out of the workers' logs and the traces (private_ids).
RESPONSES = Dialect(
    "responses",
    "/v1/responses",
    "resp_",
    chat=True,
    parse=_parse,
    error_body=APIError.body,
    keeps_request_id=False,
    private_ids=True,
)
