"""The Responses API (POST /v1/responses and its store), read by the stock openai client in strict mode.

Expectations: the prompt is transformers' apply_chat_template of the chat messages the input amounts to;
the output is the fake backend's generated text (its token ids decoded by transformers), split into
reasoning, message and function_call items as the configured parsers read it; streamed events add up to
the whole answer, in OpenAI's order, numbered without gaps; usage counts the backend's tokens; malformed
fields are a 400 naming the field the client sent; a stored response reads back as it was answered, and
a continuation's prompt is the template of the whole chain's messages."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.dialects.responses.store import ResponseStore
from gateway.text.chat_output import ChatParsers
from tests.fake_backend import API_KEYS, MODEL, OUTPUT_TEXT, FakeBackend, live_gateway, make_test_tokenizer

# Tool roles and calls rendered; the thinking opened only where chat_template_kwargs ask for it.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% else %}{{ message['content'] }}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("responses_tok"), TEMPLATE)


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=1024, chat_parsers=ChatParsers("qwen3", "hermes")) as server:
        yield server


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    return list(
        hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs)
    )


def metric(live, name: str) -> float:
    lines = httpx.get(live.base_url + "/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def events_of(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kwargs))


def test_input_and_instructions_become_the_chat_prompt(client, backend, hf_tok):
    client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.")
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    )
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
    ]
    client.responses.create(model=MODEL, input=items)
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "system", "content": "Rules."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Weather ?"},
        ],
    )


def test_function_calls_and_their_outputs_in_input_are_the_assistants_calls_and_tool_messages(client, backend, hf_tok):
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    client.responses.create(model=MODEL, input=items)
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
        for i, c in ((1, "Paris"), (2, "Rome"))
    ]
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": calls},  # two calls made together: one turn
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        ],
    )


def test_the_answer_whole_and_streamed(client, backend, hf_tok):
    r = client.responses.create(model=MODEL, input="Hi", temperature=0.5, metadata={"k": "v"})
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == OUTPUT_TEXT == hf_tok.decode(backend.output_ids)
    assert [(o.type, o.role, o.status) for o in r.output] == [("message", "assistant", "completed")]
    assert r.temperature == 0.5 and r.metadata == {"k": "v"} and r.store is True and r.tools == []
    assert backend.received[-1].sampling.temperature == 0.5
    prompt = backend.received[-1].prompt_token_ids
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        len(prompt),
        len(backend.output_ids),
        len(prompt) + len(backend.output_ids),
    )
    assert r.usage.input_tokens_details.cached_tokens == 0
    again = client.responses.create(model=MODEL, input="Hi")  # the fake backend caches whole blocks of 4
    assert (
        again.usage.input_tokens_details.cached_tokens == len(prompt) // FakeBackend.block_size * FakeBackend.block_size
    )

    events = events_of(client, input="Hi")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == OUTPUT_TEXT
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == OUTPUT_TEXT and final.usage.output_tokens == len(backend.output_ids)
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id
    with client.responses.stream(model=MODEL, input="Hi") as stream:  # the SDK's own accumulator agrees
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == OUTPUT_TEXT


def test_max_output_tokens_leaves_the_response_incomplete(client, backend, hf_tok):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert backend.received[-1].sampling.max_tokens == 5
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == hf_tok.decode(backend.output_ids[:5]) and r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 5
    events = events_of(client, input="Hi", max_output_tokens=5)
    assert (
        events[-1].type == "response.incomplete"
        and events[-1].response.incomplete_details.reason == "max_output_tokens"
    )


def test_top_logprobs_gives_the_output_texts_logprobs(client, backend, hf_tok):
    r = client.responses.create(model=MODEL, input="Hi", top_logprobs=2, max_output_tokens=6)
    logprobs = r.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [hf_tok.decode([t]) for t in backend.output_ids[:6]]
    assert [lp.logprob for lp in logprobs] == [FakeBackend.logprob_of(i) for i in range(6)]
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob for lp in logprobs)
    streamed = [
        lp
        for e in events_of(client, input="Hi", top_logprobs=2, max_output_tokens=6)
        if e.type == "response.output_text.delta"
        for lp in e.logprobs
    ]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
    r = client.responses.create(model=MODEL, input="Hi", include=["message.output_text.logprobs"], max_output_tokens=3)
    assert [(lp.logprob, lp.top_logprobs) for lp in r.output[0].content[0].logprobs] == [
        (FakeBackend.logprob_of(i), []) for i in range(3)
    ]
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=3).output[0].content[0].logprobs == []


def test_a_named_function_is_called_with_arguments_from_its_schema(client, backend, answering):
    answering('{"city": "Paris"}')
    r = client.responses.create(
        model=MODEL, input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}
    )
    assert json.loads(backend.received[-1].sampling.structured_output.spec) == TOOLS[0]["parameters"]
    (call,) = r.output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert call.call_id.startswith("call_") and r.output_text == ""
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    events = events_of(client, input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == '{"city": "Paris"}' and len(pieces) > 1


def test_required_and_auto_tool_calls_become_function_call_items(client, answering):
    answering(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    r = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required")
    assert [(o.type, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", {"city": "Paris"}),
        ("function_call", {"city": "Rome"}),
    ]
    answering('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    r = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS)  # "auto", read by hermes
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[0].content[0].text == "Let me look." and json.loads(r.output[1].arguments) == {"city": "Paris"}
    events = events_of(client, input="Weather?", tools=TOOLS)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.id) for i in done] == [(o.type, o.id) for o in events[-1].response.output]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


def test_reasoning_is_its_own_item_and_counted(client, backend, answering, hf_tok):
    answering("Think about Paris.</think>\n\nIt is sunny.")
    r = client.responses.create(model=MODEL, input="Weather?", extra_body=THINKING)
    assert hf_tok.decode(backend.received[-1].prompt_token_ids).endswith("<|assistant|>\n<think>\n")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Think about Paris." and r.output_text == "\n\nIt is sunny."
    assert r.usage.output_tokens_details.reasoning_tokens == len(
        hf_tok.encode("Think about Paris.", add_special_tokens=False)
    )
    events = events_of(client, input="Weather?", extra_body=THINKING)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Think about Paris."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nIt is sunny."
    r = client.responses.create(model=MODEL, input="Weather?", extra_body={**THINKING, "include_reasoning": False})
    assert [o.type for o in r.output] == ["message"] and r.output_text == "\n\nIt is sunny."


def test_a_json_schema_text_format_constrains_the_output(client, backend, answering):
    answering('{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_schema", "name": "thing", "schema": schema}}
    )
    so = backend.received[-1].sampling.structured_output
    assert (so.kind, json.loads(so.spec)) == ("json", schema)
    assert r.output_text == '{"a": 1}' and r.text.format.type == "json_schema"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(live, backend):
    backend.error_after_tokens = 3
    body = {"model": MODEL, "input": "Hi", "stream": True}
    with httpx.stream("POST", live.base_url + "/v1/responses", json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == names and names[-2:] == ["error", "response.failed"]
    assert "decode worker lost" in payloads[-2]["message"]
    assert (
        payloads[-1]["response"]["status"] == "failed"
        and "decode worker lost" in payloads[-1]["response"]["error"]["message"]
    )
    assert "".join(p.get("delta", "") for p in payloads) == "".join(
        payloads[-1]["response"]["output"][0]["content"][0]["text"]
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True, "store": False}, "background"),  # read back from the store: needs it
        ({"background": True, "stream": True}, "stream"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"input": [{"role": "narrator", "content": "x"}]}, "input"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"include": "message.output_text.logprobs"}, "include"),
        ({"temperature": -1}, "temperature"),
        ({"truncation": "middle"}, "truncation"),
    ],
)
def test_malformed_fields_are_a_400_naming_the_field(live, backend, extra, param):
    r = httpx.post(live.base_url + "/v1/responses", json={"model": MODEL, "input": "Hi", **extra}, headers=HEADERS)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert backend.received == []


def test_a_stored_response_reads_back_lists_its_input_and_is_deleted(client, live, backend):
    items = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    ]
    r = client.responses.create(model=MODEL, input=items, instructions="Be brief.", metadata={"k": "v"})
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [(i.role, [(c.type, c.text) for c in i.content]) for i in listed.data] == [
        ("user", [("input_text", "Hi")]),
        ("assistant", [("output_text", "Hello!")]),
        ("user", [("input_text", "Weather?")]),
    ]  # the instructions are not an item, as in OpenAI's
    ids = [i.id for i in listed.data]
    assert all(i.startswith("msg_") for i in ids) and len(set(ids)) == 3
    assert (listed.first_id, listed.last_id, listed.has_more) == (ids[0], ids[-1], False)
    assert [i.id for i in client.responses.input_items.list(r.id).data] == ids[::-1]  # "desc" by default
    pages = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.id for i in pages] == ids and pages.has_more  # the SDK follows "after" page by page
    for query, param in (
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_nope"}, "after"),
    ):
        bad = httpx.get(f"{live.base_url}/v1/responses/{r.id}/input_items", params=query, headers=HEADERS)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError, match="Only background responses can be cancelled"):
        client.responses.cancel(r.id)
    assert httpx.get(f"{live.base_url}/v1/responses/{r.id}").status_code == 401  # the key is checked first
    held = metric(live, "pdserve:stored_responses")
    assert held >= 1 and metric(live, "pdserve:stored_responses_bytes") > 0
    gone = httpx.delete(f"{live.base_url}/v1/responses/{r.id}", headers=HEADERS)
    assert metric(live, "pdserve:stored_responses") == held - 1
    assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError, match="was not stored, was deleted, or was dropped"):
            call(r.id)
    assert len(backend.received) == 1


def test_previous_response_id_goes_on_from_the_stored_chain(client, backend, answering, hf_tok):
    answering("It is sunny.")
    first = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.")
    second = client.responses.create(model=MODEL, input="And Rome?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.instructions is None
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Rome?"},
    ]
    assert backend.received[-1].prompt_token_ids == hf_ids(hf_tok, conversation)  # instructions are not carried over
    client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Thanks"}],
        instructions="In French.",
        previous_response_id=second.id,
    )
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "system", "content": "In French."},
            *conversation,
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "Thanks"},
        ],
    )
    # the agent loop: a call in one response, its output in the next request; past reasoning is dropped
    answering('Think.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    called = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, extra_body=THINKING)
    assert [o.type for o in called.output] == ["reasoning", "function_call"]
    call = called.output[-1]
    client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert backend.received[-1].prompt_token_ids == hf_ids(
        hf_tok,
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
    )


def test_streamed_and_failed_responses_are_stored_and_store_false_is_not(client, live, backend):
    events = events_of(client, input="Hi")
    final = events[-1].response
    assert final.store is True and client.responses.retrieve(final.id).model_dump() == final.model_dump()
    traced = client.responses.with_raw_response.create(model=MODEL, input="Hi", extra_headers={"X-Request-Id": "t-1"})
    assert traced.headers["x-request-id"] == "t-1" and traced.parse().id.startswith("resp_")  # the store's key: ours
    kept = client.responses.create(model=MODEL, input="Hi", store=False)

    assert kept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    backend.error_after_tokens = 3
    failed = events_of(client, input="Hi")[-1].response
    stored = client.responses.retrieve(failed.id)
    assert stored.status == "failed" and stored.error.message == failed.error.message


def test_truncation_auto_drops_the_earliest_turns_until_the_prompt_fits(client, backend, hf_tok):
    turns = [
        [
            {"role": "user", "content": f"Question {t}: " + "words " * 40},
            {"role": "assistant", "content": f"Answer {t}."},
        ]
        for t in range(12)
    ]
    items = [m for turn in turns for m in turn] + [{"role": "user", "content": "And now?"}]
    system = [{"role": "system", "content": "Be brief."}]

    def fits(messages) -> bool:  # the live gateway's context is 1024 tokens, 8 of them for the answer
        return len(hf_ids(hf_tok, messages)) + 8 <= 1024

    kept = items
    while not fits(system + kept):
        kept = kept[2:]  # the earliest turn: a question and its answer
    assert 0 < len(kept) < len(items)
    r = client.responses.create(
        model=MODEL, input=items, instructions="Be brief.", truncation="auto", max_output_tokens=8
    )
    assert backend.received[-1].prompt_token_ids == hf_ids(hf_tok, system + kept)
    assert r.truncation == "auto" and r.usage.input_tokens == len(backend.received[-1].prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="context is 1024 tokens"):
        client.responses.create(model=MODEL, input=items, instructions="Be brief.", max_output_tokens=8)  # "disabled"
    assert len(backend.received) == 1


def test_a_previous_response_that_is_not_stored_is_a_404_and_nothing_runs(client, live, backend):
    for missing in ("resp_nope", client.responses.create(model=MODEL, input="Hi", store=False).id):
        r = httpx.post(
            live.base_url + "/v1/responses",
            headers=HEADERS,
            json={"model": MODEL, "input": "Hi", "previous_response_id": missing},
        )
        assert r.status_code == 404, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (
            "previous_response_id",
            "previous_response_not_found",
        )
    assert len(backend.received) == 1


def test_with_the_store_off_nothing_is_kept_and_a_continuation_is_a_400(tok_dir):
    with live_gateway(tok_dir, max_model_len=1024, response_store=ResponseStore(0)) as server:
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
        )
        r = client.responses.create(model=MODEL, input="Hi")  # store defaults to true: not honoured, and said so
        assert r.store is False
        with pytest.raises(openai.NotFoundError, match="stores no responses"):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError, match="responses_store_mb is 0") as e:
            client.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"


def _body(rid: str, previous: str | None = None, text: str = "") -> dict:
    return {
        "id": rid,
        "previous_response_id": previous,
        "status": "completed",
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
    }


def test_the_store_drops_the_least_recently_used_past_its_budget_and_walks_chains():
    one = len(json.dumps([_body("resp_a"), []]))  # every body below is this size: ids of one length
    store = ResponseStore(3 * one)
    for rid in ("resp_a", "resp_b", "resp_c"):
        assert store.put(_body(rid), [])
    assert store.get("resp_a") is not None  # used: b is now the least recently used
    assert store.put(_body("resp_d"), [])
    assert [rid for rid in ("resp_a", "resp_b", "resp_c", "resp_d") if store.get(rid)] == ["resp_a", "resp_c", "resp_d"]
    assert store.num_bytes == 3 * one and len(store) == 3
    assert not store.put(_body("resp_e", text="x" * (3 * one)), [])  # larger than the budget: not kept, none evicted
    assert len(store) == 3
    assert not store.put(_body("resp_d", text="x" * (3 * one)), [])  # nor its earlier state kept in its place
    assert [rid for rid in ("resp_a", "resp_c", "resp_d") if store.get(rid)] == ["resp_a", "resp_c"]
    assert store.num_bytes == 2 * one

    chain = ResponseStore(1 << 20)
    question = {"type": "message", "role": "user", "id": "msg_q", "content": [{"type": "input_text", "text": "q"}]}
    chain.put(_body("resp_1", text="one"), [question])
    chain.put(_body("resp_2", "resp_1", text="two"), [])
    chain.put(_body("resp_3", "resp_2", text="three"), [question])
    assert [item.get("content")[0]["text"] for item in chain.conversation("resp_3")] == [
        "q",
        "one",
        "two",
        "q",
        "three",
    ]
    chain.delete("resp_1")
    assert chain.conversation("resp_3") == "resp_1"  # the first response of the chain that is gone
    for rid in ("resp_2", "resp_3"):
        assert chain.delete(rid)
    assert (len(chain), chain.num_bytes) == (0, 0)


def test_an_unknown_model_and_a_missing_key_are_refused_as_in_chat(live):
    r = httpx.post(live.base_url + "/v1/responses", json={"model": "other", "input": "Hi"}, headers=HEADERS)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(live.base_url + "/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 401
