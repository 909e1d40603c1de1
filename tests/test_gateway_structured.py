"""Structured outputs at the gateway: each of OpenAI's and vLLM's spellings reaches the workers as the
exact StructuredOutput record; a malformed one is a 400 naming its field and sends nothing; a worker's
refusal (a grammar that does not compile) is a 400 with the worker's reason, streaming or not."""

from __future__ import annotations

import json

import openai
import pytest

from protocol.serving import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutput
from tests.fake_backend import MODEL, FakeBackend, live_gateway, make_test_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
MESSAGES = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_gateway(make_test_tokenizer(tmp_path_factory.mktemp("tok")), max_body_bytes=1 << 18) as server:
        yield server


def _sent(backend: FakeBackend) -> StructuredOutput | None:
    (request,) = backend.received
    return request.sampling.structured_output


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput("json", SCHEMA_TEXT),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"structured_outputs": {"json": SCHEMA_TEXT}}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutput("regex", r"\d+")),
        ({"structured_outputs": {"choice": ["yes", "nö"]}}, StructuredOutput("choice", '["yes", "nö"]')),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
        ({"guided_json": SCHEMA}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"guided_regex": "[ab]+"}, StructuredOutput("regex", "[ab]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutput("grammar", 'root ::= "b"')),
    ],
)
def test_every_spelling_reaches_the_workers_as_one_record(client, backend, extra, expected):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert _sent(backend) == expected
    backend.reset()
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body=extra)
    assert _sent(backend) == expected


def test_the_stock_client_s_response_format_types_are_served(client, backend):
    client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    )
    assert _sent(backend) == StructuredOutput("json", SCHEMA_TEXT)


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"response_format": {"type": "grammar"}},
            "response_format",
            "response_format type must be 'text', 'json_object' or 'json_schema', got 'grammar'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
            "response_format",
            "response_format of type 'json_schema' needs json_schema.schema",
        ),
        ({"response_format": "json"}, "response_format", "response_format must be an object"),
        ({"guided_json": "{not json"}, "guided_json", "the JSON schema is not valid JSON"),
        ({"guided_json": [1, 2]}, "guided_json", "the JSON schema must be an object"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_regex": 5}, "guided_regex", "guided_regex must be a non-empty string"),
        (
            {"guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
            "guided_regex and guided_choice both ask for a structured output; use one",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "response_format and guided_regex both ask for a structured output; use one",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got ['regex', 'choice']",
        ),
        (
            {"structured_outputs": {}},
            "structured_outputs",
            "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got none",
        ),
        (
            {"structured_outputs": {"json_object": False}},
            "structured_outputs",
            "structured_outputs.json_object must be true when given",
        ),
        (
            {"guided_regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)},
            "guided_regex",
            f"the regex grammar has {MAX_STRUCTURED_OUTPUT_CHARS + 1} characters; at most {MAX_STRUCTURED_OUTPUT_CHARS}",
        ),
    ],
)
def test_a_malformed_structured_output_is_400_naming_the_field(client, backend, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    err = info.value.response.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert backend.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_refusal_is_a_400_with_its_reason(client, backend, stream):
    backend.refusal = "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream, extra_body={"guided_regex": "a(b"}
        )
    err = info.value.response.json()["error"]
    assert err == {"message": backend.refusal, "type": "invalid_request_error", "param": None, "code": "bad_request"}
    assert _sent(backend) == StructuredOutput("regex", "a(b")
