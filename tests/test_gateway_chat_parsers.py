"""Reasoning and "auto" tool calls at the gateway, configured as vLLM's --reasoning-parser qwen3 and
--tool-call-parser hermes, read by the stock openai client in strict mode: the message's reasoning,
content and tool_calls are exactly the parts of the generated text, streamed deltas add up to the
whole answer, chat_template_kwargs reach the template (checked against transformers' rendering), and
malformed input is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from gateway.text.chat_output import ChatParsers
from tests.fake_backend import CHAT_TEMPLATE, MODEL, live_gateway, make_test_tokenizer

# Qwen3's way: the generation prompt opens the thinking, or closes it at once with enable_thinking false
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|assistant|>\n{% endif %}",
    "<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}",
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
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("thinking_tok"), THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=256, chat_parsers=ChatParsers("qwen3", "hermes")) as server:
        yield server


def streamed(client, **kwargs) -> tuple[dict, str]:
    """The stream's deltas added up as a client does: reasoning, content, calls; the last finish_reason."""
    total, calls, finish = {"reasoning": "", "reasoning_content": "", "content": ""}, {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        total["reasoning"] += extra.get("reasoning") or ""
        total["reasoning_content"] += extra.get("reasoning_content") or ""
        total["content"] += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": c.id, "name": c.function.name, "arguments": ""})
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    total["calls"] = [calls[i] for i in sorted(calls)]
    return total, finish


def test_the_reasoning_opened_by_the_prompt_goes_to_its_own_field(client, backend, answering):
    answering("The user asks about Paris.</think>\n\nIt is sunny.")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "The user asks about Paris."
    assert message.content == "\n\nIt is sunny." and r.choices[0].finish_reason == "stop"
    total, finish = streamed(client, max_tokens=64)
    assert (
        total
        == {
            "reasoning": "The user asks about Paris.",
            "reasoning_content": "The user asks about Paris.",
            "content": "\n\nIt is sunny.",
            "calls": [],
        }
        and finish == "stop"
    )


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_all_content(client, backend, answering, hf_tok):
    answering("It is sunny.")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    expected = hf_tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, enable_thinking=False, tokenize=True, return_dict=False
    )
    assert backend.received[0].prompt_token_ids == list(expected)
    assert hf_tok.decode(expected).endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "It is sunny." and "reasoning" not in (
        r.choices[0].message.model_extra or {}
    )


def test_reasoning_then_an_auto_tool_call_whole_and_streamed(client, backend, answering):
    answering("Needs the weather tool.</think>\n\n" + CALL)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=128)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "Needs the weather tool."
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert backend.received[0].sampling.structured_output is None  # "auto" generates freely
    total, finish = streamed(client, tools=TOOLS, tool_choice="auto", max_tokens=128)
    assert finish == "tool_calls" and total["content"] == "" and total["reasoning"] == "Needs the weather tool."
    assert [(c["name"], c["arguments"]) for c in total["calls"]] == [("get_weather", '{"city": "Paris"}')]
    assert total["calls"][0]["id"].startswith("call_")


def test_auto_without_a_call_answers_the_text(client, backend, answering):
    answering("No tool needed.</think>Sunny, 20 degrees.")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=64)
    assert r.choices[0].message.content == "Sunny, 20 degrees." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_include_reasoning_false_leaves_only_the_answer(client, backend, answering):
    answering("hidden</think>Shown.")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, extra_body={"include_reasoning": False}
    )
    assert r.choices[0].message.content == "Shown." and "reasoning" not in (r.choices[0].message.model_extra or {})


def test_a_structured_output_applies_after_the_reasoning_the_prompt_opens(client, backend, answering):
    # The workers gate the grammar on the end tag (engine/sampling/structured_output.py ReasoningGate), as vLLM does.
    answering('Wants JSON.</think>{"a": 1}')
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, response_format={"type": "json_object"}
    )
    assert backend.received[-1].sampling.structured_output.after == "</think>"
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == "Wants JSON." and message.content == '{"a": 1}'
    total, finish = streamed(client, max_tokens=64, response_format={"type": "json_object"})
    assert (total["reasoning"], total["content"], finish) == ("Wants JSON.", '{"a": 1}', "stop")


def test_a_structured_output_holds_from_the_first_token_when_thinking_is_off(client, backend, answering):
    answering('{"a": "</think>"}')
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert backend.received[-1].sampling.structured_output.after == ""
    assert r.choices[0].message.content == '{"a": "</think>"}'


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must be an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs must not set 'messages'"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs must not set 'tools'"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
    ],
)
def test_malformed_fields_are_400_naming_them(client, backend, extra, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    err = info.value.response.json()["error"]
    assert err["param"] == next(iter(extra)) and message in err["message"], err
    assert backend.received == []


def test_vllm_flags_of_pdserve_serve_and_the_gateway_set_the_config():
    from cluster.roles import command_line_overrides
    from cluster.serve import cluster_env
    from cluster.serve import parse_args as serve_args
    from configs.loader import load_config
    from configs.schema import ConfigError
    from gateway.__main__ import overrides_of
    from gateway.__main__ import parse_args as gateway_args

    flags = ["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "llama3_json"]
    # what every member of the cluster gets
    env = cluster_env(command_line_overrides(serve_args(flags), "gateway"), "/m", "127.0.0.1", [8001])
    for config in (load_config(env=env), load_config(env={}, overrides=overrides_of(gateway_args(flags)))):
        assert (config.gateway.reasoning_parser, config.gateway.tool_call_parser) == ("deepseek_r1", "llama3_json")
    assert load_config(env={}).gateway.tool_call_parser == "none"
    with pytest.raises(
        ConfigError, match="gateway.tool_call_parser: must be one of none, hermes, llama3_json, pythonic, mistral"
    ):
        load_config(env={"PDSERVE_GATEWAY_TOOL_CALL_PARSER": "xlam"})
    with pytest.raises(SystemExit):
        serve_args(["--tool-call-parser", "xlam"])
