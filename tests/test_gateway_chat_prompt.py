"""How a chat request becomes prompt tokens, as vLLM takes it: add_generation_prompt,
continue_final_message, tools shown to the template (tool_choice "none" included), chat_template_kwargs,
and /tokenize with the same fields. Every expectation is transformers' apply_chat_template on the same
checkpoint tokenizer. Also parallel_tool_calls: false (one call), and malformed fields get a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.text.chat_output import ChatParsers
from tests.fake_backend import API_KEYS, CHAT_TEMPLATE, MODEL, live_gateway, make_test_tokenizer

# The tests' template, showing the tools as a system turn; its messages are trimmed (as Llama 3.1's are).
TOOLS_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ bos_token }}", "{{ bos_token }}{% if tools %}<|system|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
BEGUN = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is "}]
HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("tools_tok"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=512, chat_parsers=ChatParsers(None, "hermes")) as server:
        yield server


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    return list(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def prompt_of(client, backend, messages, **extra) -> list[int]:
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra or None)
    return backend.received[-1].prompt_token_ids


def test_continue_final_message_ends_the_prompt_inside_the_final_message(client, backend, answering, hf_tok):
    answering("sunny.")
    got = prompt_of(client, backend, BEGUN, continue_final_message=True, add_generation_prompt=False)
    expected = hf_ids(hf_tok, BEGUN, continue_final_message=True, add_generation_prompt=False)
    assert got == expected
    assert hf_tok.decode(expected).endswith("<|assistant|>\nIt is")  # trimmed by the template, so no space


def test_add_generation_prompt_false_and_the_default(client, backend, answering, hf_tok):
    answering("ok")
    messages = BEGUN[:1]
    assert prompt_of(client, backend, messages, add_generation_prompt=False) == hf_ids(
        hf_tok, messages, add_generation_prompt=False
    )
    assert prompt_of(client, backend, messages) == hf_ids(hf_tok, messages, add_generation_prompt=True)


@pytest.mark.parametrize("tool_choice", ["none", "auto", "required"])
def test_tools_reach_the_template_whatever_the_tool_choice(client, backend, answering, hf_tok, tool_choice):
    answering('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    client.chat.completions.create(model=MODEL, messages=BEGUN[:1], tools=TOOLS, tool_choice=tool_choice, max_tokens=64)
    expected = hf_ids(hf_tok, BEGUN[:1], tools=TOOLS, add_generation_prompt=True)
    assert backend.received[-1].prompt_token_ids == expected
    assert '"get_weather"' in hf_tok.decode(expected)


def test_tokenize_takes_the_chat_fields_and_returns_token_strings(live, hf_tok):
    body = {
        "messages": BEGUN,
        "tools": TOOLS,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "return_token_strs": True,
    }
    r = httpx.post(live.base_url + "/tokenize", json=body, headers=HEADERS).json()
    expected = hf_ids(hf_tok, BEGUN, tools=TOOLS, continue_final_message=True, add_generation_prompt=False)
    assert r["tokens"] == expected and r["count"] == len(expected)
    assert r["token_strs"] == hf_tok.convert_ids_to_tokens(expected)
    # The rendered template holds its special tokens: none added unless asked (vLLM's default for chat).
    r = httpx.post(
        live.base_url + "/tokenize", json={"messages": BEGUN[:1], "add_special_tokens": True}, headers=HEADERS
    ).json()
    rendered = hf_tok.apply_chat_template(BEGUN[:1], tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == hf_tok.encode(rendered, add_special_tokens=True) and "token_strs" not in r


def test_parallel_tool_calls_false_answers_the_first_auto_call_only(client, answering):
    two = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    answering(two)
    r = client.chat.completions.create(model=MODEL, messages=BEGUN[:1], tools=TOOLS, max_tokens=300)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=BEGUN[:1], tools=TOOLS, max_tokens=300, parallel_tool_calls=False
    )
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"city": "Paris"}]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    calls = [
        c
        for chunk in client.chat.completions.create(
            model=MODEL, messages=BEGUN[:1], tools=TOOLS, max_tokens=300, parallel_tool_calls=False, stream=True
        )
        if chunk.choices
        for c in chunk.choices[0].delta.tool_calls or []
    ]
    assert [(c.index, json.loads(c.function.arguments)) for c in calls] == [(0, {"city": "Paris"})]


def test_parallel_tool_calls_false_limits_the_required_grammar_to_one_call(client, backend, answering):
    answering('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    client.chat.completions.create(
        model=MODEL, messages=BEGUN[:1], tools=TOOLS, tool_choice="required", max_tokens=64, parallel_tool_calls=False
    )
    schema = json.loads(backend.received[-1].sampling.structured_output.spec)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    client.chat.completions.create(model=MODEL, messages=BEGUN[:1], tools=TOOLS, tool_choice="required", max_tokens=64)
    assert "maxItems" not in json.loads(backend.received[-1].sampling.structured_output.spec)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"continue_final_message": True}, "continue_final_message and add_generation_prompt cannot both be true"),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "messages": [{"role": "user"}]},
            "continue_final_message needs a final message with text content",
        ),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"parallel_tool_calls": 1, "tools": TOOLS}, "parallel_tool_calls"),
    ],
)
def test_malformed_chat_prompt_fields_are_a_400_naming_the_field(client, extra, message):
    body = {"messages": BEGUN, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=body.pop("messages"), max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and message in e.value.body["message"]
    assert e.value.body["param"] == next(k for k in extra if k != "messages")


def test_tokenize_refuses_malformed_chat_fields(live):
    for body, param in (
        ({"messages": BEGUN, "continue_final_message": True}, "continue_final_message"),
        ({"messages": BEGUN, "tools": "get_weather"}, "tools"),
        ({"messages": BEGUN, "return_token_strs": "yes"}, "return_token_strs"),
    ):
        r = httpx.post(live.base_url + "/tokenize", json=body, headers=HEADERS)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body


MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A gateway with --tool-call-parser mistral on a tokenizer whose [TOOL_CALLS] is a special token,
    as in Mistral's checkpoints; (server, transformers' tokenizer)."""
    from transformers import AutoTokenizer

    directory = make_test_tokenizer(tmp_path_factory.mktemp("mistral_tok"), TOOLS_TEMPLATE, ("[TOOL_CALLS]",))
    with live_gateway(directory, max_model_len=512, chat_parsers=ChatParsers(None, "mistral")) as server:
        yield server, AutoTokenizer.from_pretrained(str(directory))


def test_the_mistral_parser_reads_its_special_marker(mistral):
    server, tok = mistral
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    ids = tok.encode("Let me check." + MISTRAL_CALL, add_special_tokens=False)
    assert marker in ids and "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    server.backend.reset().output_ids = ids + [tok.eos_token_id]
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
    )
    r = client.chat.completions.create(model=MODEL, messages=BEGUN[:1], tools=TOOLS, max_tokens=300)
    message = r.choices[0].message
    assert message.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Without tools the same output is text, the special marker dropped as usual (and the EOS too).
    r = client.chat.completions.create(model=MODEL, messages=BEGUN[:1], max_tokens=300)
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_false_keeps_their_text_but_not_the_stopping_eos(client, backend, hf_tok, skip):
    ids = hf_tok.encode("Hi <|user|> there", add_special_tokens=False)
    backend.output_ids = ids + [hf_tok.eos_token_id]  # the engine's stop: the EOS ends the output
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50, extra_body={"skip_special_tokens": skip})
    assert r.choices[0].text == hf_tok.decode(ids, skip_special_tokens=skip) and r.choices[0].finish_reason == "stop"
    assert ("<|user|>" in r.choices[0].text) is (not skip) and r.usage.completion_tokens == len(ids) + 1
