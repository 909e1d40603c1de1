"""Anthropic's Messages API (POST /v1/messages, as vLLM serves it), read by the stock anthropic client in
strict mode.

Expectations: the prompt is transformers' apply_chat_template of the chat messages the request amounts
to; the content blocks are the fake backend's generated text (its token ids decoded by transformers),
split into thinking, text and tool_use blocks as the configured parsers read it; streamed events add up
to the whole message, in Anthropic's order; usage counts the backend's tokens; errors are Anthropic's
error JSON with the right status."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from gateway.text.chat_output import ChatParsers
from tests.fake_backend import API_KEYS, MODEL, FakeBackend, live_gateway, make_test_tokenizer

TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.tool_calls %}{{ message['content'] or '' }}{{ message.tool_calls | tojson }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("messages_tok"), TEMPLATE)


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=1024, chat_parsers=ChatParsers("qwen3", "hermes")) as server:
        yield server


@pytest.fixture
def claude(live, backend):
    return anthropic.Anthropic(
        base_url=live.base_url, api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
    )


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    return list(
        hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs)
    )


def ask(claude, **kwargs):
    return claude.messages.create(
        model=MODEL,
        max_tokens=kwargs.pop("max_tokens", 256),
        messages=kwargs.pop("messages", [{"role": "user", "content": "Weather?"}]),
        **kwargs,
    )


def events_of(live, **body) -> list[dict]:
    body = {
        "model": MODEL,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "Weather?"}],
        **body,
        "stream": True,
    }
    with httpx.stream("POST", live.base_url + "/v1/messages", json=body, headers={"x-api-key": API_KEYS[0]}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == names
    return events


def test_system_and_messages_become_the_chat_prompt(claude, backend, hf_tok):
    ask(
        claude,
        system="Be brief.",
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "greet", "signature": "s"},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}]},
        ],
    )
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Weather ?"},
        ],
    )
    assert backend.received[-1].sampling.max_tokens == 256


def test_tool_use_and_tool_results_are_the_assistants_calls_and_tool_messages(claude, backend, hf_tok):
    ask(
        claude,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "parameters": t["input_schema"], "description": t["description"]},
        }
        for t in TOOLS
    ]
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "Thanks"},
        ],
        tools=tools,
    )


def test_the_answer_whole_and_streamed(claude, live, backend, answering, hf_tok):
    answering("It is sunny in Paris.")
    m = ask(claude, extra_body={"temperature": 0.5, "top_k": 5})  # sampling fields the SDK no longer names
    assert (m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == (
        "message",
        "assistant",
        MODEL,
        "end_turn",
        None,
    )
    assert m.id.startswith("msg_") and [(b.type, b.text) for b in m.content] == [("text", "It is sunny in Paris.")]
    sampling = backend.received[-1].sampling
    assert (sampling.temperature, sampling.top_k) == (0.5, 5)
    prompt = backend.received[-1].prompt_token_ids
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == (
        len(prompt),
        len(backend.output_ids),
    )
    again = ask(claude)  # the fake backend caches whole blocks of 4
    assert again.usage.cache_read_input_tokens == len(prompt) // FakeBackend.block_size * FakeBackend.block_size

    events = events_of(live)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["output_tokens"] == 0
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "It is sunny in Paris."
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == len(backend.output_ids)
    with claude.messages.stream(model=MODEL, max_tokens=256, messages=[{"role": "user", "content": "Weather?"}]) as s:
        assert "".join(s.text_stream) == "It is sunny in Paris."
        final = s.get_final_message()  # the SDK's own accumulator agrees with the whole answer
    assert final.model_dump(exclude={"id"}) == again.model_dump(exclude={"id"})


def test_max_tokens_and_stop_sequences_say_why_it_stopped(claude, backend, answering, hf_tok):
    answering("Hello world. Stop here, please.")
    m = ask(claude, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.content[0].text == hf_tok.decode(backend.output_ids[:3])
    m = ask(claude, stop_sequences=["here", "Stop"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "Stop", "Hello world. ")


def test_a_named_tool_is_called_with_input_from_its_schema(claude, live, backend, answering):
    answering('{"city": "Paris"}')
    m = ask(claude, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    assert json.loads(backend.received[-1].sampling.structured_output.spec) == TOOLS[0]["input_schema"]
    (use,) = m.content
    assert (use.type, use.name, use.input, m.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"}, "tool_use")
    events = events_of(live, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"] == {
        "type": "tool_use",
        "id": start["content_block"]["id"],
        "name": "get_weather",
        "input": {},
    }
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(pieces) == '{"city": "Paris"}' and len(pieces) > 1
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_any_and_auto_tool_choices_become_tool_use_blocks(claude, backend, answering):
    answering('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    m = ask(claude, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {"city": "Paris"})]
    assert backend.received[-1].sampling.structured_output is not None
    answering("Let me look." + CALL)
    m = ask(claude, tools=TOOLS)  # "auto", read by hermes
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Let me look." and m.content[1].input == {"city": "Paris"}
    with claude.messages.stream(
        model=MODEL, max_tokens=256, tools=TOOLS, messages=[{"role": "user", "content": "Weather?"}]
    ) as s:
        final = s.get_final_message()  # the SDK's accumulator: the same blocks (a call's id is new each time)
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in m.content]
    assert final.stop_reason == "tool_use"


def test_thinking_switches_the_template_and_is_its_own_block(claude, live, backend, answering, hf_tok):
    answering("Think about Paris.</think>\n\nIt is sunny.")
    m = ask(claude, thinking={"type": "enabled", "budget_tokens": 1024})
    assert hf_tok.decode(backend.received[-1].prompt_token_ids).endswith("<|assistant|>\n<think>\n")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Think about Paris." and m.content[1].text == "\n\nIt is sunny."
    events = events_of(live, thinking={"type": "enabled", "budget_tokens": 1024})
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Think about Paris."
    assert "".join(d.get("text", "") for d in deltas) == "\n\nIt is sunny."
    ask(claude, thinking={"type": "disabled"})
    assert hf_tok.decode(backend.received[-1].prompt_token_ids).endswith("<|assistant|>\n")


def test_count_tokens_is_the_prompts_length(claude, hf_tok):
    counted = claude.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Weather?"}]
    )
    assert counted.input_tokens == len(
        hf_ids(hf_tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}])
    )


def test_a_failure_mid_stream_is_an_error_event(live, backend):
    backend.error_after_tokens = 3
    events = events_of(live)
    assert events[-1]["type"] == "error" and "decode worker lost" in events[-1]["error"]["message"]
    assert events[0]["type"] == "message_start"


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error"),  # no max_tokens
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error"),
        ({"max_tokens": None, "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error"),
        ({"max_tokens": 8, "messages": []}, 400, "invalid_request_error"),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "tool"}},
            400,
            "invalid_request_error",
        ),
        ({"model": "other", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}, 404, "not_found_error"),
    ],
)
def test_bad_requests_get_anthropics_error_json(live, backend, body, status, kind):
    r = httpx.post(live.base_url + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": API_KEYS[0]})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and r.json()["error"]["message"]
    assert backend.received == []


def test_the_key_goes_in_x_api_key_or_a_bearer_header(live, backend):
    url, body = (
        live.base_url + "/v1/messages",
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": API_KEYS[1]}, {"Authorization": f"Bearer {API_KEYS[0]}"}):
        assert httpx.post(url, json=body, headers=headers).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.base_url, api_key="nope", max_retries=0).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
