"""Every error reaches the official client as the right exception, with OpenAI's error JSON."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fake_backend import API_KEYS, MODEL, live_gateway, make_test_tokenizer, num_requests_running

MAX_MODEL_LEN = 32
MAX_BODY = 4096


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_gateway(
        make_test_tokenizer(tmp_path_factory.mktemp("tok")),
        max_model_len=MAX_MODEL_LEN,
        max_body_bytes=MAX_BODY,
        request_timeout_s=1.0,
    ) as server:
        yield server


def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in e.response.text
    return body["error"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-10),
        ("max_tokens", 0),
        ("logprobs", 21),
        ("seed", "x"),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop_token_ids", [-1]),
        ("min_tokens", -1),
        ("ignore_eos", "yes"),
        ("n", True),
        ("user", 5),
    ],
)
def test_out_of_range_field_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", extra_body={field: value})
    err = _error(info.value)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert field in err["message"]


def test_nan_and_infinity_are_rejected(live, backend):
    headers = {"Authorization": f"Bearer {API_KEYS[0]}", "Content-Type": "application/json"}
    for field, raw in (("temperature", "NaN"), ("top_p", "Infinity"), ("presence_penalty", "-Infinity")):
        payload = f'{{"model": "{MODEL}", "prompt": "x", "{field}": {raw}}}'.encode()
        r = httpx.post(live.base_url + "/v1/completions", content=payload, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_chat_field_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert _error(info.value)["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert _error(info.value)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # the template's raise_exception
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert "unknown role tool" in _error(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", extra_body={"stream_options": {"include_usage": True}})
    assert _error(info.value)["param"] == "stream_options"


def test_min_tokens_above_max_tokens(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"min_tokens": 3})
    assert _error(info.value)["param"] == "min_tokens"


def test_malformed_json_and_non_object_body(live, backend):
    headers = {"Authorization": f"Bearer {API_KEYS[0]}", "Content-Type": "application/json"}
    for payload in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(live.base_url + "/v1/completions", content=payload, headers=headers)
        assert r.status_code == 400, payload
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_context_names_both_numbers(client):
    ids = [5] * (MAX_MODEL_LEN + 3)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    message = _error(info.value)["message"]
    assert str(MAX_MODEL_LEN + 3) in message and str(MAX_MODEL_LEN) in message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 10, max_tokens=MAX_MODEL_LEN)
    err = _error(info.value)
    assert err["param"] == "max_tokens" and f"{10 + MAX_MODEL_LEN}" in err["message"]


def test_token_id_out_of_vocab(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=1)
    assert "1000000" in _error(info.value)["message"]


@pytest.mark.parametrize(
    "value, message",
    [
        ([1, 2], "logit_bias must be an object mapping token ids to numbers"),
        ({"abc": 1}, "logit_bias keys must be token ids (non-negative integers), got 'abc'"),
        ({"-1": 1}, "logit_bias keys must be token ids"),
        ({"5": 100.5}, "logit_bias[5] must be a number in [-100, 100], got 100.5"),
        ({"5": "up"}, "logit_bias[5] must be a number in [-100, 100], got 'up'"),
        ({"5": 1, "1000000": 1}, "logit_bias token id 1000000 is out of range [0, "),
        ({"9" * 20: 1}, "logit_bias keys must be token ids"),  # more digits than an int64 has
    ],
)
def test_bad_logit_bias_is_400_naming_it(client, backend, value, message, caplog):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logit_bias=value)
    err = _error(info.value)
    assert err["param"] == "logit_bias" and message in err["message"] and len(err["message"]) < 400
    assert backend.received == []
    assert not [r for r in caplog.records if r.exc_info], "a bad logit_bias logged a traceback"


def test_a_stop_string_longer_than_the_bound_is_400(client, backend):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, stop=["x" * 1025])
    err = _error(info.value)
    assert err["param"] == "stop" and "at most 1024 characters, got 1025" in err["message"]
    assert backend.received == []


@pytest.mark.parametrize(
    "chat, extra, param, message",
    [
        (False, {"suffix": "x"}, "suffix", "suffix is not supported"),
        (False, {"best_of": 3}, "best_of", "best_of other than n is not supported"),
        (
            True,
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
            "tool_choice 'auto' needs a parser of the model's free-form tool calls",
        ),
        (
            True,
            {"functions": [{"name": "f"}]},
            "functions",
            "tool calling with the legacy functions (use tools) is not",
        ),
    ],
)
def test_a_field_this_server_cannot_honour_is_400_not_ignored(client, backend, chat, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_body=extra
            )
        else:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body=extra)
    err = _error(info.value)
    assert err["param"] == param and message in err["message"]
    assert backend.received == []


def test_the_harmless_forms_of_those_fields_are_served(client, backend):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, echo=False, best_of=2, n=2, suffix="")
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        response_format={"type": "text"},
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",
    )
    assert [r.sampling.n for r in backend.received] == [2, 1]


def test_wrong_or_missing_key_is_401(live, backend):
    bad = openai.OpenAI(base_url=live.base_url + "/v1", api_key="nope", max_retries=0, _strict_response_validation=True)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL, prompt="Hello")
    assert _error(info.value)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(live.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401
    for path in ("/metrics", "/health"):  # open without a key
        assert httpx.get(live.base_url + path).status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}])
    err = _error(info.value)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_body_too_large_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="a" * (MAX_BODY + 1))
    assert info.value.status_code == 413
    assert str(MAX_BODY) in _error(info.value)["message"]


def test_no_capacity_is_503_with_retry_after(client, backend, live):
    backend.capacity = False  # the gateway's admission check
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="Hello")
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "3"
    assert _error(info.value)["type"] == "service_unavailable"
    backend.capacity = True
    backend.no_capacity_retry_after = 7  # the backend refuses when asked to generate
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "7"
    assert num_requests_running(live.base_url) == 0


def test_worker_error_mid_stream_is_in_band(client, backend, live):
    backend.error_after_tokens = 3
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=10
    )
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "decode worker lost" in str(info.value.message)
    raw = httpx.post(
        live.base_url + "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEYS[0]}"},
        json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 10},
    ).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    r = httpx.post(
        live.base_url + "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEYS[0]}"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 10},
    )
    assert r.status_code == 500 and "decode worker lost" in r.json()["error"]["message"]
    assert num_requests_running(live.base_url) == 0


def test_unknown_route_is_openai_shaped_404(live):
    r = httpx.get(live.base_url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_deadline_ends_a_slow_request_and_aborts_it(client, backend):
    backend.token_delay_s = 0.3  # 10 tokens take 3 s; the gateway's request timeout is 1 s
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=10)
    assert "timed out after 1.0 s" in _error(info.value)["message"]
    assert backend.aborted == [backend.received[0].request_id]
    assert backend.received[0].deadline == pytest.approx(backend.received[0].arrival_time + 1.0)


@pytest.mark.parametrize(
    "tools, message",
    [
        (
            [{"type": "function", "function": {"name": "n" * 65, "parameters": {}}}],
            "tools[0].function.name may have at most 64 characters, got 65",
        ),
    ],
)
def test_tool_definitions_beyond_openais_bounds_are_400(client, backend, tools, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools)
    err = _error(info.value)
    assert err["param"] == "tools" and err["message"] == message
    assert backend.received == []
