"""Issue 6 acceptance: the official openai client, in strict mode, against a real ``pdserve serve``
(gateway + prefill + decode processes). Every feature a client uses is checked against an independent
expectation: the single-process engine (``engine.llm.LLM``) for text, tokens and logprobs, the chat
template applied by ``transformers`` for chat prompts, and the SDK's own exception classes for errors.

The cluster is sized so that each error is reachable on purpose: a context of 1024 tokens (longer
prompts: 400) but a KV pool of 40 blocks x 16 tokens = 640 tokens and no admission queue, so a prompt
that fits the context but not the pool is a 503 with Retry-After."""

from __future__ import annotations

import json
import time
import urllib.request

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

KEY = "sk-e2e-test-key"
BLOCK = 16
CONTEXT = 1024
POOL_BLOCKS = 40  # 640 tokens: less than the context on purpose (503 below)
MODEL = str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("cluster"),
        model={"max_model_len": CONTEXT},
        engine={"block_size": BLOCK, "num_kv_blocks": POOL_BLOCKS, "prefill_chunk_size": 32},
        gateway={
            "api_keys": [KEY],
            "max_queued_requests": 0,
            "local_prefill_max_tokens": 0,
            "tool_call_parser": "hermes",
            "reasoning_parser": "qwen3",
        },
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, block_size=BLOCK)


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=120, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def loose_client(cluster):
    """For legacy completion streams only: the SDK types CompletionChoice.finish_reason as non-optional, so
    strict validation rejects the ``finish_reason: null`` that OpenAI itself sends in every non-final chunk."""
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_output(reference: LLM, prompt: list[int], **params):
    [out] = reference.generate([prompt], SamplingParams(**params))
    return out.outputs


def wait_idle(cluster: ServeProcess) -> None:
    """The harness's wait_idle without auth: /v1/workers needs the key here."""
    request = urllib.request.Request(f"{cluster.url}/v1/workers", headers={"Authorization": f"Bearer {KEY}"})
    for _ in range(150):
        workers = json.loads(urllib.request.urlopen(request, timeout=5).read())["data"]
        if workers and all(w["load"]["kv_blocks_in_use"] == 0 and w["load"]["num_running"] == 0 for w in workers):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not idle: {workers}")


def test_completion_greedy_equals_engine_stream_and_not(client, loose_client, reference, cluster):
    prompt = prompt_of(37, seed=1)
    [expected] = engine_output(reference, prompt, temperature=0.0, max_tokens=10, ignore_eos=True)
    text = reference.tokenizer.decode(expected.token_ids)
    r = client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (37, 10, 47)
    chunks = list(
        loose_client.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=10,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 37
    assert all(c.usage is None for c in chunks[:-1])
    wait_idle(cluster)


def test_chat_greedy_equals_engine_on_the_chat_template(client, reference, hf_tok, cluster):
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    [expected] = engine_output(reference, ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    text = reference.tokenizer.decode(expected.token_ids)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + 8
    wait_idle(cluster)


def test_responses_api_greedy_equals_engine_on_the_chat_template_and_goes_on_from_a_stored_answer(
    client, reference, hf_tok, cluster
):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes."}]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    [expected] = engine_output(reference, ids, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    text = reference.tokenizer.decode(expected.token_ids)
    r = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Tell me about foxes.",
        max_output_tokens=8,
        temperature=0.0,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.output_text == text and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), 8)
    got = r.output[0].content[0].logprobs
    assert [lp.logprob for lp in got] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input="Tell me about foxes.",
            max_output_tokens=8,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.total_tokens == len(ids) + 8
    # going on from the stored response: the prompt is the whole conversation's template
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And wolves?"}]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    [expected] = engine_output(reference, ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    after = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="And wolves?",
        previous_response_id=r.id,
        max_output_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert after.output_text == reference.tokenizer.decode(expected.token_ids) and after.usage.input_tokens == len(ids)
    assert client.responses.retrieve(after.id).output_text == after.output_text
    wait_idle(cluster)


def test_anthropic_messages_greedy_equals_engine_on_the_chat_template(reference, hf_tok, cluster):
    import anthropic

    claude = anthropic.Anthropic(
        base_url=cluster.url, api_key=KEY, max_retries=0, timeout=120, _strict_response_validation=True
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about owls."}]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    [expected] = engine_output(reference, ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    text = reference.tokenizer.decode(expected.token_ids)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    m = claude.messages.create(
        model=MODEL,
        system="Be brief.",
        max_tokens=8,
        extra_body=greedy,
        messages=[{"role": "user", "content": "Tell me about owls."}],
    )
    assert [(b.type, b.text) for b in m.content] == [("text", text)] and m.stop_reason == "max_tokens"
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == (len(ids), 8)
    with claude.messages.stream(
        model=MODEL,
        system="Be brief.",
        max_tokens=8,
        extra_body=greedy,
        messages=[{"role": "user", "content": "Tell me about owls."}],
    ) as stream:
        assert "".join(stream.text_stream) == text
    assert claude.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Tell me about owls."}]
    ).input_tokens == len(ids)
    wait_idle(cluster)


def test_a_seeded_completion_over_prefill_and_decode_equals_one_engine(client, reference, cluster):
    # the prefill worker samples token 0 from the seed's stream; the decode worker must go on from there
    prompt = prompt_of(33, seed=12)
    [expected] = engine_output(reference, prompt, max_tokens=8, ignore_eos=True, temperature=1.0, seed=1234)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    wait_idle(cluster)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.3, "top_p": 0.9, "min_p": 0.02},
        {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"temperature": 1.0, "logit_bias": {"7": 5.0, "11": -100.0}, "min_tokens": 4},
    ],
)
def test_seeded_sampling_settings_over_prefill_and_decode_equal_one_engine(client, reference, cluster, sampling):
    prompt = prompt_of(29, seed=13)
    engine_params = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in sampling.items()}
    [expected] = engine_output(reference, prompt, max_tokens=8, seed=99, **engine_params)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        seed=99,
        logprobs=0,
        extra_body={**sampling, "return_tokens_as_token_ids": True},
    )
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    wait_idle(cluster)


def test_allowed_token_ids_greedy_and_seeded_equal_engine_over_prefill_and_decode(client, reference, cluster):
    prompt = prompt_of(40, seed=5)
    allowed = [7, 11, 300, 301, 700]
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 21}):
        [expected] = engine_output(
            reference, prompt, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed, **sampling
        )
        assert set(expected.token_ids) <= set(allowed)
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            logprobs=0,
            **sampling,
            extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
        )
        # the first token sampled on the prefill worker, the rest on the decode worker: both apply the mask
        assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    wait_idle(cluster)


def test_n2_with_seed_equals_engine_and_repeats(client, reference, cluster):
    prompt = prompt_of(21, seed=2)
    expected = engine_output(reference, prompt, n=2, temperature=1.0, seed=77, max_tokens=6, ignore_eos=True)
    want = [reference.tokenizer.decode(c.token_ids) for c in expected]
    for _ in range(2):  # same seed -> same text, every time
        r = client.completions.create(
            model=MODEL, prompt=[prompt], n=2, temperature=1.0, seed=77, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert want[0] != want[1]  # the two choices really are different samples
    chat = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            seed=5,
            temperature=1.0,
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
    assert [c.index for c in chat[0].choices] == [0, 1]
    wait_idle(cluster)


def test_stop_string_truncates_and_never_leaks(client, loose_client, reference, cluster):
    prompt = prompt_of(19, seed=3)
    [expected] = engine_output(reference, prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
    full = reference.tokenizer.decode(expected.token_ids)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    want = full[: full.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=16, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(
        loose_client.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=16,
            temperature=0.0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(cluster)


def test_logprobs_equal_the_engine(client, reference, cluster):
    prompt = prompt_of(25, seed=4)
    [expected] = engine_output(reference, prompt, temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    r = client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=5, temperature=0.0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-3)
    for got, want in zip(lp.top_logprobs, expected.logprobs):
        assert len(got) == 2
        assert list(got.values()) == pytest.approx([p for _, p in want.top], abs=1e-3)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    wait_idle(cluster)


def test_logit_bias_equals_the_engine_on_both_workers(client, reference, cluster):
    # The prefill worker samples the first token and the decode worker the rest: both must apply it.
    prompt = prompt_of(29, seed=6)
    [plain] = engine_output(reference, prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[4]: -100.0, 9: 3.0}
    [expected] = engine_output(reference, prompt, temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    assert expected.token_ids[0] != plain.token_ids[0]
    assert plain.token_ids[0] not in expected.token_ids and plain.token_ids[4] not in expected.token_ids
    r = client.completions.create(
        model=MODEL,
        prompt=[prompt],
        max_tokens=8,
        temperature=0.0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == reference.tokenizer.decode(expected.token_ids)
    forced = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=1.0,
        logit_bias={"400": 100},
        logprobs=True,
    )
    assert forced.choices[0].message.content == reference.tokenizer.decode([400] * 5)
    assert forced.usage.completion_tokens == 5
    # Logprobs are the model's, before the bias (vLLM's default): far from the biased certainty of 0.
    assert all(c.logprob < -1.0 for c in forced.choices[0].logprobs.content)
    wait_idle(cluster)


def test_structured_outputs_equal_the_engine_on_both_workers(client, loose_client, reference, cluster):
    """The prefill worker samples the first token under the grammar, the decode worker feeds it to its own
    matcher and goes on: greedy output equals the single engine's, and it parses."""
    from protocol.serving import StructuredOutput

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99999}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Give me JSON."}]
    ids = list(
        reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    [expected] = engine_output(
        reference, ids, temperature=0.0, max_tokens=40, structured_output=StructuredOutput("json", json.dumps(schema))
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
    )
    content = r.choices[0].message.content
    assert content == reference.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop"
    reply = json.loads(content)
    assert set(reply) == {"n", "ok"} and isinstance(reply["n"], int) and isinstance(reply["ok"], bool)

    choices = ["red", "green", "blue"]
    prompt = prompt_of(23, seed=9)
    got = client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=10, temperature=1.0, seed=3, n=2, extra_body={"guided_choice": choices}
    )
    assert [c.text in choices and c.finish_reason == "stop" for c in got.choices] == [True, True]
    streamed = list(
        loose_client.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=12,
            temperature=0.0,
            stream=True,
            extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"},
        )
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    [regex_expected] = engine_output(
        reference,
        prompt,
        temperature=0.0,
        max_tokens=12,
        structured_output=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
    )
    assert text == reference.tokenizer.decode(regex_expected.token_ids, skip_special_tokens=True)
    assert len(text) == 6 and text[3] == "-"
    wait_idle(cluster)


def test_forced_tool_calls_equal_the_engine_under_the_same_schema(client, reference, cluster):
    from gateway.text.tool_calls import ToolChoice
    from protocol.serving import StructuredOutput

    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ids = list(
        reference.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    [expected] = engine_output(
        reference, ids, temperature=0.0, max_tokens=40, structured_output=StructuredOutput("json", json.dumps(weather))
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        max_tokens=40,
        temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == reference.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert set(json.loads(call.function.arguments)) == {"city"}
    # "required": the engine under the array-of-calls schema (gateway/text/tool_calls.py) gives the calls.
    [expected] = engine_output(
        reference, ids, temperature=0.0, max_tokens=120, structured_output=ToolChoice(tools, None).structured_output()
    )
    assert expected.finish_reason == "stop"
    calls = json.loads(reference.tokenizer.decode(expected.token_ids, skip_special_tokens=True))
    required = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=120, temperature=0.0, tool_choice="required"
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in required.choices[0].message.tool_calls] == [
        (c["name"], c["parameters"]) for c in calls
    ]
    wait_idle(cluster)


def test_auto_tool_calls_are_read_out_of_the_model_text(client, reference, cluster):
    """tool_choice "auto" with the cluster's hermes parser. A random model makes no calls of its own, so a
    regex holds its greedy output to the hermes shape; the call the gateway reads must be the one in the
    engine's text under the same regex, and without tools the same text is the plain answer."""
    import re

    from protocol.serving import StructuredOutput

    pattern = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ids = list(
        reference.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    [expected] = engine_output(
        reference, ids, temperature=0.0, max_tokens=150, structured_output=StructuredOutput("regex", pattern)
    )
    text = reference.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert expected.finish_reason == "stop" and re.fullmatch(pattern, text)
    arguments = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="auto",
        max_tokens=150,
        temperature=0.0,
        extra_body={"guided_regex": pattern},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", arguments)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=150, temperature=0.0, extra_body={"guided_regex": pattern}
    )
    assert plain.choices[0].message.content == text and plain.choices[0].message.tool_calls is None
    wait_idle(cluster)


def test_a_grammar_that_does_not_compile_is_400_with_the_reason(client, cluster):
    for extra, reason in (
        ({"guided_regex": "a(b"}, "invalid regex: Regex parsing error at position 4"),
        ({"guided_json": {"type": "nope"}}, 'invalid JSON schema: Unsupported type "nope"'),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
            )
        assert reason in info.value.response.json()["error"]["message"]
    wait_idle(cluster)


def test_echo_logprobs_score_the_prompt_as_transformers_does(client, loose_client, reference, cluster):
    """What lm-evaluation-harness's loglikelihood asks of a completions server: echo, logprobs, max_tokens 1.
    The prompt is prefilled on the prefill worker (n = 1) after an identical prompt filled the caches."""
    from transformers import AutoModelForCausalLM

    prompt = prompt_of(45, seed=8)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)  # row p predicts prompt token p + 1
    want = [rows[p, t].item() for p, t in enumerate(prompt[1:])]
    [generated] = engine_output(reference, prompt, temperature=0.0, max_tokens=1, logprobs=1)
    client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1, temperature=0.0)  # warms both caches
    # Loose: the SDK types token_logprobs as floats, but the first prompt token has none (as in vLLM).
    r = loose_client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=1, temperature=0.0, logprobs=1, echo=True
    )
    choice, tok = r.choices[0], reference.tokenizer
    assert choice.text == tok.decode(prompt) + tok.decode(generated.token_ids)
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in prompt + generated.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(want, abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(generated.logprobs[0].logprob, abs=1e-4)
    assert [list(top) for top in lp.top_logprobs[1:-1]] == [[tok.decode([int(rows[p].argmax())])] for p in range(44)]
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the prompt was computed: cached tokens have no logits
    # vLLM's prompt_logprobs, with n = 2 (prefilled on the decode worker): the token's rank and the top 2.
    r = client.completions.create(
        model=MODEL, prompt=[prompt], max_tokens=2, temperature=0.0, n=2, extra_body={"prompt_logprobs": 2}
    )
    for choice in r.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == 45
        for p, entry in enumerate(got[1:]):
            token, top = prompt[p + 1], rows[p].topk(2)
            assert entry[str(token)]["logprob"] == pytest.approx(want[p], abs=1e-4)
            assert entry[str(token)]["rank"] == int((rows[p] > rows[p, token]).sum()) + 1
            assert set(entry) == {str(token), *map(str, top.indices.tolist())}
    wait_idle(cluster)


def test_invalid_field_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1.0)
    assert info.value.status_code == 400 and "temperature" in info.value.message
    assert info.value.body["param"] == "temperature"


def test_prompt_longer_than_context_is_400_with_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[prompt_of(CONTEXT + 76, seed=5)], max_tokens=4)
    assert str(CONTEXT + 76) in info.value.message and str(CONTEXT) in info.value.message


def test_missing_or_wrong_key_is_401(cluster):
    wrong = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key="sk-wrong", max_retries=0, _strict_response_validation=True
    )
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    response = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 401 and response.json()["error"]["type"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in info.value.message


def test_body_too_large_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (2 << 20), max_tokens=2)
    assert info.value.status_code == 413
    assert info.value.body["type"]


def test_no_decode_room_is_503_with_retry_after(client, cluster):
    # 800 tokens fit the 1024-token context but need 51 blocks of a 40-block pool; no queue -> 503 now.
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt=[prompt_of(800, seed=6)], max_tokens=4)
    assert info.value.status_code == 503
    assert int(info.value.response.headers["retry-after"]) >= 1
    # and the cluster still serves
    r = client.completions.create(
        model=MODEL, prompt=[prompt_of(8, seed=7)], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 2
    wait_idle(cluster)
