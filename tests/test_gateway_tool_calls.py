"""Forced tool calls at the gateway: tool_choice "required" or a named function becomes the exact JSON
schema the workers follow, and the output comes back as OpenAI tool_calls, whole or streamed, read by
the stock client in strict mode; every malformed tools / tool_choice is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from protocol.serving import StructuredOutput
from tests.fake_backend import MODEL, live_gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = '{"city": "Paris"}'
CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=256) as server:
        yield server


def test_a_named_function_follows_its_parameters_and_answers_a_tool_call(client, backend, answering):
    answering(ARGS)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
    assert backend.received[0].sampling.structured_output == StructuredOutput("json", json.dumps(WEATHER))
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", ARGS)
    assert call.id.startswith("call_")


def test_required_follows_an_array_of_calls_and_answers_each(client, backend, answering):
    answering(CALLS)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=128
    )
    schema = json.loads(backend.received[0].sampling.structured_output.spec)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"name": {"const": "get_time"}, "parameters": {"type": "object", "properties": {}}},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
            ]
        },
    }
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", ARGS),
        ("get_time", "{}"),
    ]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_required_cut_by_max_tokens_answers_the_text(client, backend, answering):
    answering(CALLS)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=5
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert CALLS.startswith(choice.message.content) and choice.message.content


@pytest.mark.parametrize("tool_choice, text", [(NAMED, ARGS), ("required", CALLS)])
def test_streamed_tool_calls_add_up_to_the_whole_answer(client, backend, answering, tool_choice, text):
    answering(text)
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=128
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=128, stream=True
        )
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert all(not c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"tools": TOOLS}, "tool_choice", "tool_choice 'auto' needs a parser of the model's free-form tool calls"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs a parser"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice other than 'none' needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "tool_choice names function 'nope', which is not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "sometimes"},
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
            "tools",
            "tools must be a non-empty list of",
        ),
        (
            {"tools": [{"type": "code_interpreter"}], "tool_choice": "required"},
            "tools",
            "tools must be a non-empty list of",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "required"},
            "tools",
            "tools must be a non-empty list of",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
            "tool_choice and a structured output both constrain the output; use one",
        ),
    ],
)
def test_malformed_tools_or_tool_choice_is_400_naming_the_field(client, backend, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    err = info.value.response.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert backend.received == []


def test_tool_choice_none_keeps_plain_text(client, backend, answering):
    answering("Sunny.")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content == "Sunny." and r.choices[0].message.tool_calls is None
    assert backend.received[0].sampling.structured_output is None
