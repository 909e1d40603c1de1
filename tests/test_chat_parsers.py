"""The chat output readers on their own: reasoning split off at <think>...</think>, and a model's own tool
calls read out of hermes, llama3_json, pythonic, mistral, qwen3_coder, deepseek_v3 and granite text. Each case states the exact
expected (reasoning, content, calls), and the same text streamed in every possible two-piece split, and
one character at a time, must add up to exactly that: a tag or a call cut across deltas never leaks or
gets lost."""

from __future__ import annotations

import functools
import json
import operator

import pytest

from gateway.text.chat_output import ChatOutput, ChatShape, chat_message
from gateway.text.reasoning.think_tags import ThinkTagParser
from gateway.text.tool_calls import ToolChoice
from gateway.text.tool_parsers import make_reader

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
PARIS = ("get_weather", '{"city": "Paris"}')
ROME = ("get_weather", '{"city": "Rome", "days": 2}')


def splits(text: str) -> list[list[str]]:
    """The text whole, in every split into two pieces, and one character at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


def fed(feed, pieces: list[str]) -> tuple:
    """``feed(piece, final)`` over the pieces, the parts of its answers added up."""
    answers = [feed(piece, k == len(pieces) - 1) for k, piece in enumerate(pieces)]
    return tuple(functools.reduce(operator.add, parts) for parts in zip(*answers))


def read_tools(parser: str, pieces: list[str], tools: list[dict] | None = None) -> tuple[str, list[tuple[str, str]]]:
    return fed(make_reader(parser, tools).feed, pieces)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Sunny today.", "Sunny today.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [PARIS]),
        (
            'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>',
            "Let me check.",
            [PARIS, ROME],
        ),  # the space around the calls is not part of the answer
        # cut off before the closing tag (max_tokens, or a stop token right after the JSON): still a call
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
        # not a call after all: the text comes back as it was
        ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"ci',
            '<tool_call>{"name": "get_weather", "arguments": {"ci',
            [],
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ("a < b and <tool", "a < b and <tool", []),
    ],
)
def test_hermes_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("hermes", pieces) == (content, calls), pieces


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        (
            '  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "arguments": '
            '{"city": "Rome", "days": 2}}\n',
            "",
            [PARIS, ROME],
        ),
        ("It is sunny.", "It is sunny.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}} and more',
            '{"name": "get_weather", "parameters": {"city": "Paris"}} and more',
            [],
        ),
        ('{"name": "get_weather", "parameters": {"ci', '{"name": "get_weather", "parameters": {"ci', []),
    ],
)
def test_llama3_json_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("llama3_json", pieces) == (content, calls), pieces


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_whole_output_parsers_stream_plain_text_without_waiting_for_the_end(parser):
    reader = make_reader(parser)
    assert reader.feed("  ", final=False) == ("", [])  # could still become a call
    assert reader.feed("It", final=False) == ("  It", [])
    assert reader.feed(" is", final=False) == (" is", [])


def test_hermes_streams_text_up_to_a_possible_tag():
    reader = make_reader("hermes")
    assert reader.feed("Let me <to", final=False) == ("Let me", [])  # the space waits: a call may follow
    assert reader.feed("day>", final=False) == (" <today>", [])


SEARCH = ("search", '{"q": "café", "tags": ["a", "b"], "opts": {"deep": true, "n": null}, "span": [1, 2.5], "neg": -3}')


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('[get_weather(city="Paris")]', "", [PARIS]),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', "", [PARIS]),
        (" [get_weather(city=\"Paris\"),\n get_weather(city='Rome', days=2)]\n", "", [PARIS, ROME]),
        # literal values only, as JSON: True/False/None, nested lists and dicts, tuples as lists, negative numbers
        ('[search(q="café", tags=["a", \'b\'], opts={"deep": True, "n": None}, span=(1, 2.5), neg=-3)]', "", [SEARCH]),
        ("[get_time()]", "", [("get_time", "{}")]),
        ("It is sunny.", "It is sunny.", []),
        ("<b>bold</b>", "<b>bold</b>", []),  # began like <|python_start|>, then was not
        # not a list of calls after all: the text comes back as it was
        ('[get_weather(city="Paris")', '[get_weather(city="Paris")', []),  # unbalanced (or cut off)
        ('[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional arguments
        ("[f(x=y)]", "[f(x=y)]", []),  # a name, not a literal: never looked up
        ('[f(x=open("/etc/passwd"))]', '[f(x=open("/etc/passwd"))]', []),  # a call as a value: never run
        ("[f(**{'a': 1})]", "[f(**{'a': 1})]", []),
        ("[f(a=1, a=2)]", "[f(a=1, a=2)]", []),
        ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set has no JSON
        ("[os.remove(path='x')]", "[os.remove(path='x')]", []),  # not a plain name
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[]", "[]", []),
        ('[get_weather(city="Paris")] and more', '[get_weather(city="Paris")] and more', []),
    ],
)
def test_pythonic_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("pythonic", pieces) == (content, calls), pieces


def test_pythonic_holds_what_starts_like_its_tag():
    reader = make_reader("pythonic")
    assert reader.feed("<|python", final=False) == ("", [])
    assert reader.feed('_start|>[get_weather(city="Paris")]', final=False) == ("", [])  # held to the end
    assert reader.feed("<|python_end|>", final=True) == ("", [PARIS])


@pytest.mark.parametrize(
    "text, content, calls",
    [
        # tokenizers before v11: a JSON array after the marker
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
            '"arguments": {"city": "Rome", "days": 2}}]',
            "",
            [PARIS, ROME],
        ),
        # v11 on: the name, then the arguments, the marker before each call; [ARGS], [CALL_ID] where kept
        (
            '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_weather{"city": "Rome", "days": 2}',
            "",
            [PARIS, ROME],
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', "", [PARIS]),
        (
            '[TOOL_CALLS]search{"q": "café", "tags": ["a", "b"], "opts": {"deep": true, "n": null}, "span": [1, 2.5], '
            '"neg": -3}',
            "",
            [SEARCH],
        ),
        ('Let me check.\n[TOOL_CALLS]get_weather{"city": "Paris"}', "Let me check.", [PARIS]),
        # text after the calls stays content, as in vLLM
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]\nextra trailing data',
            "\nextra trailing data",
            [PARIS],
        ),
        ("Sunny today.", "Sunny today.", []),
        ("a [TOOLS] b [TOOL", "a [TOOLS] b [TOOL", []),
        # not calls after all: the marker and the text come back as they were
        ('[TOOL_CALLS]get_weather{"city": Paris}', '[TOOL_CALLS]get_weather{"city": Paris}', []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
            [],
        ),
        ('Hi [TOOL_CALLS][{"arguments": {}}]', 'Hi [TOOL_CALLS][{"arguments": {}}]', []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
        ("[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),
        (
            '[TOOL_CALLS]get_weather{"city": "Paris"} and [TOOL_CALLS]get_weather{"city": "Rome", "days": 2}',
            '[TOOL_CALLS]get_weather{"city": "Paris"} and [TOOL_CALLS]get_weather{"city": "Rome", "days": 2}',
            [],
        ),
    ],
)
def test_mistral_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("mistral", pieces) == (content, calls), pieces


def test_mistral_streams_text_up_to_the_marker():
    reader = make_reader("mistral")
    assert reader.feed("Let me check", final=False) == ("Let me check", [])
    assert reader.feed(". [TOOL", final=False) == (".", [])  # the space waits: a call may follow
    assert reader.feed('_CALLS]get_weather{"city": ', final=False) == ("", [])  # held to the end
    assert reader.feed('"Paris"}', final=True) == ("", [PARIS])


# qwen3_coder's values are raw text: the request's schemas type them
QWEN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "i": {"type": "integer"},
                    "n": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "u": {"description": "no type"},
                },
            },
        },
    },
]


def qwen_call(name: str, *parameters: tuple[str, str]) -> str:
    return (
        f"<tool_call>\n<function={name}>\n"
        + "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
        + "</function>\n</tool_call>"
    )


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Sunny today.", "Sunny today.", []),
        (qwen_call("get_weather", ("city", "Paris")), "", [PARIS]),
        (
            "Let me check.\n"
            + qwen_call("get_weather", ("city", "Paris"))
            + "\n"
            + qwen_call("get_weather", ("city", "Rome"), ("days", "2")),
            "Let me check.",
            [PARIS, ROME],
        ),
        # typed by the schema; "null" is None whatever the type; a number that is whole goes out whole
        (
            qwen_call(
                "convert",
                ("s", "2"),
                ("i", "2"),
                ("n", "2.5"),
                ("b", "True"),
                ("o", '{"deep": true}'),
                ("a", "[1, 'x']"),
                ("u", "null"),
            ),
            "",
            [("convert", '{"s": "2", "i": 2, "n": 2.5, "b": true, "o": {"deep": true}, "a": [1, "x"], "u": null}')],
        ),
        # what does not read as its type stays the text (a boolean other than true is false, as in vLLM); only
        # one newline either side is the format's
        (
            qwen_call("convert", ("i", "two"), ("n", "3.0"), ("b", "yes"), ("o", "{not json"), ("s", "\n a\nb \n")),
            "",
            [("convert", '{"i": "two", "n": 3, "b": false, "o": "{not json", "s": "\\n a\\nb \\n"}')],
        ),
        # a parameter with no type, or not in the schema, stays the text, as in vLLM
        (qwen_call("convert", ("u", "2"), ("extra", "[1]")), "", [("convert", '{"u": "2", "extra": "[1]"}')]),
        (qwen_call("lookup", ("x", "2")), "", [("lookup", '{"x": "2"}')]),  # not among the tools: still a call
        # a parameter ends where the next one or the function's end begins, as in vLLM's reading
        ("<tool_call><function=get_weather><parameter=city>Rome<parameter=days>2</function></tool_call>", "", [ROME]),
        # cut off (max_tokens): still a call, with the parameters read whole; the one left open may be cut short
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2",
            "",
            [PARIS],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool",
            "",
            [ROME],
        ),
        # not a call after all: the text comes back as it was
        ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
        ("<tool_call>\nhello\n</tool_call> ok", "<tool_call>\nhello\n</tool_call> ok", []),
        ("a < b and <tool", "a < b and <tool", []),
    ],
)
def test_qwen3_coder_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("qwen3_coder", pieces, QWEN_TOOLS) == (content, calls), pieces


def test_qwen3_coder_gets_the_requests_tools():
    text = qwen_call("get_weather", ("city", "Rome"), ("days", "2"))
    message, finish = chat_message(ChatShape(tool_choice=ToolChoice(QWEN_TOOLS, None, "qwen3_coder")), text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [ROME]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("pythonic", '[get_weather(city="Paris")]'),
        ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}'),
    ],
)
def test_pythonic_and_mistral_calls_end_the_message_with_tool_calls(parser, text):
    message, finish = chat_message(ChatShape(tool_choice=ToolChoice(TOOLS, None, parser)), text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [PARIS]


@pytest.mark.parametrize(
    "parser, opening",
    [
        ("hermes", "<tool_call>"),
        ("llama3_json", ""),
        ("pythonic", "[f(a="),
        ("mistral", "[TOOL_CALLS]f"),
        ("mistral", "[TOOL_CALLS]["),
        ("granite", "<tool_call>["),
        (
            "deepseek_v3",
            "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>f<\uff5ctool\u2581sep\uff5c>",
        ),
    ],
)
def test_text_nested_deeper_than_the_decoders_go_is_content(parser, opening):
    text = opening + '{"a": ' * 100_000  # json and ast give up (RecursionError, SyntaxError): not a call
    assert make_reader(parser).feed(text, final=True) == (text, [])


def read_reasoning(opened_by_prompt: bool, pieces: list[str]) -> tuple[str, str]:
    return fed(ThinkTagParser(opened_by_prompt).feed, pieces)


@pytest.mark.parametrize(
    "opened_by_prompt, text, reasoning, content",
    [
        (False, "<think>\nStep one.\n</think>\n\nThe answer.", "\nStep one.\n", "\n\nThe answer."),
        (False, "\n<think>a</think>b", "a", "b"),
        (False, "The answer, no thinking.", "", "The answer, no thinking."),
        (False, "<thinking is fun", "", "<thinking is fun"),
        (False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
        (True, "Step one.</think>The answer.", "Step one.", "The answer."),
        (True, "<think>Step one.</think>The answer.", "Step one.", "The answer."),  # the tag repeated
        (True, "never closed", "never closed", ""),
        (False, "<think></think>x </think> y", "", "x </think> y"),
    ],
)
def test_reasoning_splits_at_every_split(opened_by_prompt, text, reasoning, content):
    for pieces in splits(text):
        assert read_reasoning(opened_by_prompt, pieces) == (reasoning, content), pieces


def test_a_prompt_opens_reasoning_when_it_ends_with_think():
    assert ThinkTagParser.prompt_opens("<|assistant|>\n<think>\n")
    assert not ThinkTagParser.prompt_opens("<|assistant|>\n<think>\n\n</think>\n\n")
    assert not ThinkTagParser.prompt_opens("<|assistant|>\n")


def stream(shape: ChatShape, pieces: list[str], finish_reason: str) -> tuple[dict, str | None]:
    """The deltas of ``pieces`` added up the way a client does, with the last finish_reason."""
    out, total, last = ChatOutput(shape), {"reasoning": "", "content": "", "calls": {}}, None
    for k, piece in enumerate(pieces):
        delta, finish = out.feed(piece, finish_reason if k == len(pieces) - 1 else None)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        total["reasoning"] += delta.get("reasoning", "")
        total["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            entry = total["calls"].setdefault(call["index"], {"id": call.get("id"), "name": None, "arguments": ""})
            entry["name"] = call["function"].get("name", entry["name"])
            entry["arguments"] += call["function"]["arguments"]
        last = finish or last
    return total, last


def test_reasoning_then_a_hermes_call_streamed_equals_the_whole_message():
    shape = ChatShape(reasoning="qwen3", tool_choice=ToolChoice(TOOLS, None, "hermes"))
    text = (
        '<think>Paris weather needs a tool.</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    )
    message, finish = chat_message(shape, text, "stop")
    assert finish == "tool_calls"
    assert message["reasoning"] == message["reasoning_content"] == "Paris weather needs a tool."
    assert message["content"] is None  # the blank line between reasoning and call is not an answer
    [call] = message["tool_calls"]
    assert (call["type"], call["function"]) == ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    for pieces in (list(text), [text[:40], text[40:90], text[90:]]):
        total, last = stream(shape, pieces, "stop")
        assert last == "tool_calls" and total["reasoning"] == message["reasoning"] and total["content"] == ""
        assert [(c["name"], c["arguments"]) for c in total["calls"].values()] == [("get_weather", '{"city": "Paris"}')]
        assert all(c["id"].startswith("call_") for c in total["calls"].values())


def test_include_reasoning_false_drops_the_reasoning_but_still_splits_it_off():
    message, finish = chat_message(
        ChatShape(reasoning="qwen3", include_reasoning=False), "<think>hm</think>Yes.", "stop"
    )
    assert message == {"role": "assistant", "content": "Yes."} and finish == "stop"


def test_without_parsers_the_text_is_the_content_as_generated():
    text = "<think>hm</think><tool_call>{}</tool_call>"
    assert chat_message(ChatShape(), text, "length") == ({"role": "assistant", "content": text}, "length")


def test_auto_with_no_call_keeps_the_finish_reason_and_the_text():
    shape = ChatShape(tool_choice=ToolChoice(TOOLS, None, "llama3_json"))
    assert chat_message(shape, "Sunny.", "length") == ({"role": "assistant", "content": "Sunny."}, "length")
    message, finish = chat_message(shape, json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']


# DeepSeek's markers (special tokens: with this parser the detokenizer keeps them, as with mistral's)
DS_BEGIN, DS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL, DS_SEP, DS_CALL_END = (
    "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<\uff5ctool\u2581sep\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>",
)
DS_PARIS = DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": "Paris"}\n```' + DS_CALL_END  # V3, R1
DS_ROME = DS_CALL + "get_weather" + DS_SEP + '{"city": "Rome", "days": 2}' + DS_CALL_END  # V3.1


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (DS_BEGIN + DS_PARIS + DS_END, "", [PARIS]),
        ("Let me check.\n" + DS_BEGIN + DS_PARIS + DS_ROME + DS_END, "Let me check.", [PARIS, ROME]),
        (DS_BEGIN + DS_ROME + DS_END + "\nDone.", "\nDone.", [ROME]),
        (DS_BEGIN + DS_PARIS + DS_ROME[:-5], "", [PARIS]),  # cut off: the complete call stands, the cut one is dropped
        ("Sunny today.", "Sunny today.", []),
        # not calls after all: the text comes back as it was
        (
            DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + "{city: Paris}" + DS_CALL_END + DS_END,
            DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + "{city: Paris}" + DS_CALL_END + DS_END,
            [],
        ),
        (
            DS_BEGIN + DS_CALL + DS_SEP + "{}" + DS_CALL_END + DS_END,
            DS_BEGIN + DS_CALL + DS_SEP + "{}" + DS_CALL_END + DS_END,
            [],
        ),
        (DS_BEGIN + DS_END, DS_BEGIN + DS_END, []),
    ],
)
def test_deepseek_v3_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("deepseek_v3", pieces) == (content, calls), pieces


def test_deepseek_v3_keeps_special_tokens_in_the_output_it_reads():
    from gateway.dialects.openai.request import parse_chat

    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    assert parse_chat(body, "deepseek_v3").skip_special_tokens is False
    assert parse_chat(body, "hermes").skip_special_tokens is True


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),  # Granite 3.1 on
        (
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome", '
            '"days": 2}}]',
            "",
            [PARIS, ROME],
        ),  # 3.0: its <|tool_call|> special token already dropped
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),  # ... or kept
        ("Sunny today.", "Sunny today.", []),
        # not calls after all: the text comes back as it was
        (
            '<tool_call>[{"name": "get_weather", "arguments": {"ci',
            '<tool_call>[{"name": "get_weather", "arguments": {"ci',
            [],
        ),
        (
            '[{"name": "get_weather", "arguments": {}}] and more',
            '[{"name": "get_weather", "arguments": {}}] and more',
            [],
        ),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("<tool_call>[]", "<tool_call>[]", []),
    ],
)
def test_granite_reads_calls_at_every_split(text, content, calls):
    for pieces in splits(text):
        assert read_tools("granite", pieces) == (content, calls), pieces
