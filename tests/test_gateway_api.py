"""The OpenAI API over a live uvicorn server, checked with the official client in strict mode."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.workers.registry import WorkerRegistry
from protocol.serving import Heartbeat, TokenBias
from tests import prom
from tests.fake_backend import API_KEYS, MODEL, OUTPUT_TEXT, FakeBackend, live_gateway, num_requests_running, wait_until


@pytest.fixture(scope="module")
def live(tok_dir):
    registry = WorkerRegistry()
    registry.observe(
        Heartbeat(
            "decode-0",
            "decode",
            "tcp://127.0.0.1:7101",
            "inc-1",
            block_size=4,
            kv_blocks_total=64,
            kv_blocks_free=57,
            kv_blocks_in_use=7,
            num_running=2,
            num_waiting=0,
            queued_prefill_tokens=0,
        ),
        now=0.0,
    )
    with live_gateway(tok_dir, max_model_len=128, registry=registry) as server:
        yield server


@pytest.fixture
def client(live, backend):
    return openai.OpenAI(
        base_url=live.base_url + "/v1", api_key=API_KEYS[1], max_retries=0, _strict_response_validation=True
    )


@pytest.fixture
def loose_client(live, backend):
    """For legacy completion streams only: the SDK types CompletionChoice.finish_reason as non-optional, so
    strict validation rejects the ``finish_reason: null`` that OpenAI itself sends in every non-final chunk."""
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=API_KEYS[1], max_retries=0)


def test_completion_non_stream_text_usage_and_cached_tokens(client, hf_tok, backend):
    prompt = "The quick brown fox jumps over"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    assert r.choices[0].text == OUTPUT_TEXT
    assert r.choices[0].finish_reason == "stop"
    num_prompt = len(hf_tok.encode(prompt))
    assert r.usage.prompt_tokens == num_prompt
    assert r.usage.completion_tokens == len(backend.output_ids)
    assert r.usage.total_tokens == num_prompt + len(backend.output_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    assert again.usage.prompt_tokens_details.cached_tokens == num_prompt // backend.block_size * backend.block_size
    assert backend.received[0].prompt_token_ids == hf_tok.encode(prompt)


def test_completion_max_tokens_gives_length_and_matches_transformers_decode(client, hf_tok, backend):
    for k in (1, 3, 14, 15):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=k)
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == hf_tok.decode(backend.output_ids[:k])
        assert r.usage.completion_tokens == k


def test_token_id_prompts_and_several_prompts(client, hf_tok, backend):
    ids = hf_tok.encode("A cat sat")
    r = client.completions.create(model=MODEL, prompt=[ids, hf_tok.encode("the mat")], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(ids) + len(hf_tok.encode("the mat"))
    assert r.usage.completion_tokens == 8
    assert backend.received[0].prompt_token_ids == ids


def test_completion_stream_has_no_empty_chunks(loose_client, backend):
    chunks = list(loose_client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == OUTPUT_TEXT
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert len({c.id for c in chunks}) == 1


def test_chat_non_stream(client, hf_tok, backend):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=50)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == OUTPUT_TEXT
    expected_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert backend.received[0].prompt_token_ids == list(expected_ids)
    assert r.usage.prompt_tokens == len(expected_ids)


def test_chat_stream_role_first_and_usage_chunk_last(client, backend):
    backend.tokens_per_event = 2
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=40,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(backend.output_ids)
    body = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == OUTPUT_TEXT
    assert all(c.choices[0].delta.content or c.choices[0].finish_reason for c in body)
    assert body[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_puts_each_choices_count_so_far_on_every_chunk(client, loose_client, backend, hf_tok):
    backend.tokens_per_event = 2
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options=options,
            max_tokens=40,
        )
    )
    prompt = len(backend.received[-1].prompt_token_ids)
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (prompt, 0)  # the role chunk
    text = ""
    for c in chunks[1:-1]:
        text += c.choices[0].delta.content or ""
        count = c.usage.completion_tokens
        assert c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + count
        # the tokens counted are the ones whose text went out (a token's text may wait for the next one)
        assert count % 2 == 0 or count == len(backend.output_ids)
        assert hf_tok.decode(backend.output_ids[:count]).startswith(text)
    assert chunks[-2].usage.completion_tokens == chunks[-1].usage.completion_tokens == len(backend.output_ids)
    # per choice, as vLLM counts: two completions of one prompt each count their own tokens
    chunks = list(
        loose_client.completions.create(
            model=MODEL, prompt="Hi", n=2, stream=True, stream_options=options, max_tokens=40
        )
    )
    for index in (0, 1):
        counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == index]
        assert counts == sorted(counts) and counts[-1] == len(backend.output_ids)
    # without include_usage it is off, as in vLLM
    plain = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"continuous_usage_stats": True},
            max_tokens=4,
        )
    )
    assert all(c.usage is None for c in plain)


def test_logit_bias_reaches_the_backend_as_typed_entries(client, backend):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias={"7": -100, "42": 2.5})
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logit_bias={"3": 100}
    )
    assert [r.sampling.logit_bias for r in backend.received] == [
        [TokenBias(7, -100.0), TokenBias(42, 2.5)],
        [TokenBias(3, 100.0)],
    ]
    assert [type(b.bias) for b in backend.received[0].sampling.logit_bias] == [float, float]


def test_n2_streams_two_choices_from_one_backend_request(loose_client, backend):
    chunks = list(loose_client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2, seed=11, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts[0] == texts[1] == OUTPUT_TEXT[: len(texts[0])] and texts[0]
    # one request carries n: the worker forks the completions (and seeds completion j with seed + j)
    assert [(r.sampling.n, r.sampling.seed) for r in backend.received] == [(2, 11)]


def _split_stop(hf_tok, backend) -> str:
    """A stop string that spans a token boundary of the fake output: no single token holds it."""
    stop = "d. St"
    pieces = [hf_tok.decode([t]) for t in backend.output_ids]
    assert not any(stop in p for p in pieces) and stop in OUTPUT_TEXT
    return stop


def test_stop_string_across_tokens_non_stream(client, hf_tok, backend):
    stop = _split_stop(hf_tok, backend)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, stop=[stop, "zzz"])
    assert r.choices[0].text == OUTPUT_TEXT[: OUTPUT_TEXT.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert backend.aborted == [backend.received[0].request_id]  # the worker is told to stop


@pytest.mark.parametrize("per_event", [1, 3])
def test_stop_string_never_leaks_in_stream(client, hf_tok, backend, per_event):
    backend.tokens_per_event = per_event
    stop = _split_stop(hf_tok, backend)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=stop, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == OUTPUT_TEXT[: OUTPUT_TEXT.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client, hf_tok, backend):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    ids = backend.output_ids[:4]
    assert lp.tokens == [hf_tok.decode([t]) for t in ids]
    assert lp.token_logprobs == [FakeBackend.logprob_of(i) for i in range(4)]
    assert [len(t) for t in lp.top_logprobs] == [2, 2, 2, 2]
    assert lp.top_logprobs[0][hf_tok.decode([ids[0] + 1])] == FakeBackend.logprob_of(0) - 1
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_stream_and_not(client, hf_tok, backend):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [hf_tok.decode([t]) for t in backend.output_ids[:5]]
    assert [c.logprob for c in content] == [FakeBackend.logprob_of(i) for i in range(5)]
    assert all(len(c.top_logprobs) == 3 for c in content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks[1:] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [FakeBackend.logprob_of(i) for i in range(5)]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(client, backend):
    ids = backend.output_ids[:4]
    extra = {"return_tokens_as_token_ids": True}  # vLLM's
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in ids]
    assert [c.bytes for c in content] == [list(f"token_id:{t}".encode()) for t in ids]
    assert [[t.token for t in c.top_logprobs] for c in content] == [[f"token_id:{t}", f"token_id:{t + 1}"] for t in ids]
    assert r.choices[0].message.content == OUTPUT_TEXT[: len(r.choices[0].message.content)]  # the text stays text
    streamed = [
        e.token
        for c in list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                logprobs=True,
                stream=True,
                extra_body=extra,
            )
        )[1:]
        if c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [f"token_id:{t}" for t in ids]
    lp = (
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=1, extra_body=extra)
        .choices[0]
        .logprobs
    )
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert lp.top_logprobs[0] == {f"token_id:{ids[0]}": FakeBackend.logprob_of(0)}


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, live, backend, hf_tok):
    ids = list(range(10, 40))
    client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 8})
    assert backend.received[-1].prompt_token_ids == ids[-8:]
    messages = [{"role": "user", "content": "Tell me about the quick brown fox"}]
    client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert backend.received[-1].prompt_token_ids == list(rendered)[-5:]
    long = list(range(10, 210))  # 200 tokens, a context of 128: -1 keeps 128, which leaves no room (vLLM's answer too)
    r = httpx.post(
        live.base_url + "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEYS[0]}"},
        json={"model": MODEL, "prompt": long, "max_tokens": 2, "truncate_prompt_tokens": -1},
    )
    assert r.status_code == 400 and "prompt has 128 tokens" in r.json()["error"]["message"]
    for k in (0, 129, -2):
        r = httpx.post(
            live.base_url + "/v1/completions",
            headers={"Authorization": f"Bearer {API_KEYS[0]}"},
            json={"model": MODEL, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": k},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", k


def test_a_logprob_of_minus_infinity_goes_out_as_vllms_floor(client, backend, monkeypatch):
    # A token the grammar rules out has logprob -inf, which JSON cannot carry: it was a 500 (found by the fuzzer).
    monkeypatch.setattr(
        FakeBackend, "logprob_of", staticmethod(lambda position: float("-inf") if position == 1 else -0.5)
    )
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.5, -9999.0, -0.5]
    assert [t.logprob for t in content[1].top_logprobs] == [-9999.0, -9999.0]
    streamed = [
        e.logprob
        for c in list(client.chat.completions.create(**chat, stream=True))[1:]
        if c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [-0.5, -9999.0, -0.5]
    lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1).choices[0].logprobs
    assert lp.token_logprobs == [-0.5, -9999.0, -0.5] and list(lp.top_logprobs[1].values()) == [-9999.0]


def test_models_and_open_endpoints(client, live):
    assert [m.id for m in client.models.list()] == [MODEL]
    for path in ("/health", "/ready", "/version", "/openapi.json", "/metrics"):
        assert httpx.get(live.base_url + path).status_code == 200, path
    assert "/v1/chat/completions" in httpx.get(live.base_url + "/openapi.json").json()["paths"]


def test_ready_is_503_without_workers(live, backend):
    backend.ready = False
    r = httpx.get(live.base_url + "/ready")
    assert r.status_code == 503


def test_tokenize_detokenize_match_transformers(live, hf_tok):
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    text = "Hello wörld 日本語"
    r = httpx.post(live.base_url + "/tokenize", json={"prompt": text}, headers=headers).json()
    assert r["tokens"] == hf_tok.encode(text) and r["count"] == len(r["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(live.base_url + "/tokenize", json={"messages": messages}, headers=headers).json()
    assert r["tokens"] == list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    ids = hf_tok.encode(text)
    r = httpx.post(live.base_url + "/detokenize", json={"tokens": ids}, headers=headers).json()
    assert r["prompt"] == hf_tok.decode(ids) == text


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_requests_and_tokens(client, live, backend, hf_tok):
    before = httpx.get(live.base_url + "/metrics").text
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2)
    text = httpx.get(live.base_url + "/metrics").text
    for name, labels, delta in (
        ("vllm:generation_tokens_total", {}, 6),
        ("vllm:prompt_tokens_total", {}, len(hf_tok.encode("Hello"))),
        ("vllm:request_success_total", {"finished_reason": "length"}, 2),  # n=2, max_tokens
        ("vllm:request_decode_time_seconds_count", {}, 2),
        ("vllm:time_per_output_token_seconds_count", {}, 2),
        ("vllm:request_generation_tokens_count", {}, 1),
        ("pdserve:requests_total", {"outcome": "success"}, 1),
    ):
        if name.startswith("vllm:"):
            labels = {"model_name": MODEL, **labels}
        assert prom.total(text, name, **labels) - prom.total(before, name, **labels) == delta, name
    assert _metric(text, "pdserve:num_requests_running") == 0
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        'pdserve:requests_total{outcome="success"}',
        "pdserve:cached_prompt_tokens_total",
        "process_resident_memory_bytes",
    ):
        assert name in text, name


def test_client_disconnect_mid_stream_aborts(live, backend):
    backend.token_delay_s = 0.05
    backend.output_ids = backend.output_ids * 10
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "stream": True}
    with (
        httpx.Client() as http,
        http.stream(
            "POST", live.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEYS[0]}"}
        ) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
    rid = backend.received[0].request_id
    wait_until(lambda: rid in backend.aborted, "backend.abort was not called after the client went away")
    assert backend.aborted == [rid]
    wait_until(lambda: num_requests_running(live.base_url) == 0, "request still counted as running")


def test_client_disconnect_non_stream_aborts(live, backend):
    backend.token_delay_s = 0.05
    backend.output_ids = backend.output_ids * 5
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            live.base_url + "/v1/completions",
            json=body,
            timeout=0.3,
            headers={"Authorization": f"Bearer {API_KEYS[0]}"},
        )
    rid = backend.received[0].request_id
    wait_until(lambda: rid in backend.aborted, "backend.abort was not called after the client went away")
    wait_until(lambda: num_requests_running(live.base_url) == 0, "request still counted as running")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_before_the_first_token_aborts_at_once(live, backend, stream):
    """A long queue or prefill: the client leaves before any token, and the backend hears of it then,
    not when the first token comes (4 s later here)."""
    backend.token_delay_s = 4.0
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            live.base_url + "/v1/completions",
            json=body,
            timeout=0.3,
            headers={"Authorization": f"Bearer {API_KEYS[0]}"},
        )
    rid = backend.received[0].request_id
    wait_until(
        lambda: rid in backend.aborted, "backend.abort was not called while waiting for the first token", timeout_s=2.0
    )
    wait_until(lambda: num_requests_running(live.base_url) == 0, "request still counted as running")


def test_workers_lists_the_registry(live, backend):
    r = httpx.get(live.base_url + "/v1/workers", headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    assert r.json()["data"] == [
        {
            "id": "decode-0",
            "role": "decode",
            "address": "tcp://127.0.0.1:7101",
            "incarnation": "inc-1",
            "draining": False,
            "stuck": False,
            "steps_completed": 0,
            "step_running_s": 0.0,
            "block_size": 4,
            "lora_names": [],
            "hot_lora_names": [],
            "load": {
                "num_running": 2,
                "num_waiting": 0,
                "queued_prefill_tokens": 0,
                "kv_blocks_in_use": 7,
                "kv_blocks_free": 57,
                "kv_blocks_total": 64,
            },
        }
    ]
    assert httpx.get(live.base_url + "/v1/workers").status_code == 401


def test_x_request_id_names_the_answer_and_comes_back(client, live, backend):
    headers = {"X-Request-Id": "trace-42"}
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=3, extra_headers=headers)
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "cmpl-trace-42"
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_headers=headers)
    first, second = (r.request_id for r in backend.received)
    assert (
        first.startswith("cmpl-trace-42-") and second.startswith("cmpl-trace-42-") and first != second
    )  # reused: a nonce
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True, extra_headers=headers
    )
    assert {chunk.id for chunk in stream} == {"chatcmpl-trace-42"}
    answer = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, extra_headers=headers
    )
    assert answer.headers["x-request-id"] == "trace-42" and answer.parse().id == "chatcmpl-trace-42"
    auth = {"Authorization": f"Bearer {API_KEYS[0]}"}
    refused = httpx.post(
        live.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": -1}, headers={**auth, **headers}
    )
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "trace-42"  # errors carry it too
    plain = httpx.post(
        live.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=auth
    )
    assert "x-request-id" not in plain.headers and plain.json()["id"].startswith("cmpl-")
    for bad in ("x" * 129, "two words", "caf\u00e9"):
        r = httpx.post(
            live.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
            headers={**auth, "X-Request-Id": bad.encode("latin-1")},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        assert "x-request-id" not in r.headers
    assert len(backend.received) == 5


def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_a_choice(client, loose_client, backend, hf_tok):
    backend.output_ids = hf_tok.encode(OUTPUT_TEXT, add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, stop=["here", "Stop"])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == (
        "Hello world. ",
        "stop",
        "Stop",
    )  # the string found first in the text, as vLLM reports it
    last = backend.output_ids[-1]  # the fake backend ends on this token with "stop", as a worker does on a stop id
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=64, extra_body={"stop_token_ids": [last]}
    )
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", last)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64)  # ended by the model (EOS)
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", None)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stop=["Stop"])
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("length", None)
    chunks = list(
        loose_client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, stop=["Stop"], stream=True)
    )
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in final] == [("stop", "Stop")]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=64,
            stream=True,
            extra_body={"stop_token_ids": [last]},
        )
    )
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in final] == [("stop", last)]


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(client, loose_client, backend, hf_tok):
    backend.output_ids = hf_tok.encode(OUTPUT_TEXT, add_special_tokens=False)
    backend.tokens_per_event = 1  # the stop string arrives split over several events
    kw = dict(
        model=MODEL,
        prompt="Hello",
        max_tokens=64,
        stop=["here", "Stop"],
        extra_body={"include_stop_str_in_output": True},
    )
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == (
        "Hello world. Stop",
        "stop",
        "Stop",
    )
    streamed = list(loose_client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "Hello world. Stop"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=64,
        stop=["world"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert chat.choices[0].message.content == "Hello world"
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, stop=["Stop"]).choices[0].text == (
        "Hello world. "
    )  # without it, as before: the stop string never reaches the client


def test_allowed_token_ids_reach_the_workers_and_bad_ones_are_a_400(client, live, backend):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"allowed_token_ids": [5, 9]})
    assert backend.received[-1].sampling.allowed_token_ids == [5, 9]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert backend.received[-1].sampling.allowed_token_ids is None
    auth = {"Authorization": f"Bearer {API_KEYS[0]}"}
    for bad in ([], [10**6], [-1], "5"):
        r = httpx.post(
            live.base_url + "/v1/completions",
            headers=auth,
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "allowed_token_ids": bad},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", (bad, r.text)
    assert len(backend.received) == 2
