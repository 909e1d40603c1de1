"""Completions' ``echo`` and vLLM's ``prompt_logprobs`` over a live gateway, checked as exact JSON.

Expectations are computed here from the fake backend's documented values (prompt position p >= 1: logprob
-1 - 0.5 p, rank 1 + p % 3, top j: the prompt token at its rank, else byte id (t + 1 + j) % 256, logprob
0.25 less per place) and from transformers' decoding of the test tokenizer, never from gateway code.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fake_backend import API_KEYS, MODEL, FakeBackend, live_gateway

HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=128) as server:
        yield server


def post(live, path: str, **body) -> httpx.Response:
    return httpx.post(live.base_url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=10)


def stream(live, path: str, **body) -> list[dict]:
    """The SSE chunks of a streamed response, [DONE] checked and dropped."""
    with httpx.stream(
        "POST", live.base_url + path, json={"model": MODEL, "stream": True, **body}, headers=HEADERS, timeout=10
    ) as r:
        assert r.status_code == 200
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# --- expectations, from the fake backend's documented numbers -------------------------------------------


def prompt_logprob(p: int) -> float:
    return -1.0 - 0.5 * p


def prompt_rank(p: int) -> int:
    return 1 + p % 3


def prompt_top(token_id: int, p: int, k: int) -> list[tuple[int, float]]:
    rank = prompt_rank(p)
    return [
        (token_id if j == rank - 1 else (token_id + 1 + j) % 256, prompt_logprob(p) + 0.25 * (rank - 1 - j))
        for j in range(k)
    ]


def expected_logprobs(hf_tok, prompt_ids: list[int] | None, output_ids: list[int], k: int) -> dict:
    """OpenAI's completion logprobs of [echoed prompt] + output: None for the first prompt token."""

    def token(t: int) -> str:
        return hf_tok.decode([t])

    tokens, logprobs, tops = [], [], []
    for p, t in enumerate(prompt_ids or []):
        tokens.append(token(t))
        logprobs.append(None if p == 0 else prompt_logprob(p))
        tops.append(None if p == 0 else {token(x): lp for x, lp in prompt_top(t, p, k)})
    for i, t in enumerate(output_ids):
        tokens.append(token(t))
        logprobs.append(FakeBackend.logprob_of(i))
        tops.append({token(t + j): FakeBackend.logprob_of(i) - j for j in range(k)})
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def expected_prompt_logprobs(hf_tok, prompt_ids: list[int], k: int) -> list[dict | None]:
    out: list[dict | None] = [None]
    for p, t in enumerate(prompt_ids[1:], start=1):
        entry = {str(t): {"logprob": prompt_logprob(p), "rank": prompt_rank(p), "decoded_token": hf_tok.decode([t])}}
        for j, (x, lp) in enumerate(prompt_top(t, p, k)):
            if x != t:
                entry[str(x)] = {"logprob": lp, "rank": j + 1, "decoded_token": hf_tok.decode([x])}
        out.append(entry)
    return out


# --- echo ------------------------------------------------------------------------------------------------


def test_echo_without_logprobs_prepends_the_prompt_and_asks_no_prompt_logprobs(live, backend, hf_tok):
    prompt = "The quick brown fox"
    r = post(live, "/v1/completions", prompt=prompt, max_tokens=5, echo=True)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt + hf_tok.decode(backend.output_ids[:5])
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice
    assert r.json()["usage"]["prompt_tokens"] == len(hf_tok.encode(prompt))  # the echo is not counted again
    assert backend.received[0].sampling.prompt_logprobs is None  # text alone needs no prompt logprobs


def test_echo_through_the_official_client(backend, live, hf_tok):
    client = openai.OpenAI(
        base_url=live.base_url + "/v1", api_key=API_KEYS[1], max_retries=0, _strict_response_validation=True
    )
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True)
    assert r.choices[0].text == "Hello world" + hf_tok.decode(backend.output_ids[:3])


def test_echo_with_logprobs_covers_the_prompt_then_the_output(live, backend, hf_tok):
    prompt = "The quick brown fox"
    ids = hf_tok.encode(prompt)
    r = post(live, "/v1/completions", prompt=prompt, max_tokens=4, logprobs=2, echo=True)
    choice = r.json()["choices"][0]
    out = backend.output_ids[:4]
    assert choice["text"] == prompt + hf_tok.decode(out)
    assert choice["logprobs"] == expected_logprobs(hf_tok, ids, out, 2)
    assert choice["logprobs"]["token_logprobs"][:2] == [None, -1.5]
    assert choice["logprobs"]["text_offset"][len(ids)] == len(prompt)  # the output starts where the prompt ends
    assert "prompt_logprobs" not in choice  # not asked for explicitly
    assert backend.received[0].sampling.prompt_logprobs == 2  # echo + logprobs: vLLM's rule


def test_echo_of_a_token_id_prompt_is_the_decoded_prompt(live, backend, hf_tok):
    ids = hf_tok.encode("A cat sat")
    r = post(live, "/v1/completions", prompt=ids, max_tokens=3, echo=True, logprobs=0)
    choice = r.json()["choices"][0]
    assert choice["text"] == "A cat sat" + hf_tok.decode(backend.output_ids[:3])
    assert choice["logprobs"] == expected_logprobs(hf_tok, ids, backend.output_ids[:3], 0)


def test_echo_with_n2_and_two_prompts_echoes_each_prompt_in_each_of_its_choices(live, backend, hf_tok):
    prompts = ["Hello world", "A cat"]
    r = post(live, "/v1/completions", prompt=prompts, n=2, max_tokens=3, echo=True, logprobs=1)
    body = r.json()
    out = backend.output_ids[:3]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        prompt = prompts[c["index"] // 2]
        assert c["text"] == prompt + hf_tok.decode(out)
        assert c["logprobs"] == expected_logprobs(hf_tok, hf_tok.encode(prompt), out, 1)
    assert body["usage"]["prompt_tokens"] == sum(len(hf_tok.encode(p)) for p in prompts)
    assert body["usage"]["completion_tokens"] == 4 * 3


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("per_event", [1, 3])
def test_streamed_echo_adds_up_to_the_non_streamed_answer(live, backend, hf_tok, logprobs, per_event):
    backend.tokens_per_event = per_event
    prompt = "Hello world"
    kw = dict(prompt=prompt, max_tokens=7, n=2, echo=True, logprobs=logprobs)
    whole = post(live, "/v1/completions", **kw).json()["choices"]
    chunks = stream(live, "/v1/completions", **kw)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith(prompt) and len(mine[0]["text"]) > len(prompt)  # prompt + first delta
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        if logprobs is None:
            assert all(c["logprobs"] is None for c in mine)
            continue
        joined = {key: [v for c in mine for v in c["logprobs"][key]] for key in whole[index]["logprobs"]}
        assert joined == whole[index]["logprobs"]
        assert joined == expected_logprobs(hf_tok, hf_tok.encode(prompt), backend.output_ids[:7], 2)


# --- prompt_logprobs -------------------------------------------------------------------------------------


def test_prompt_logprobs_on_completions_exact_structure(live, backend, hf_tok):
    prompt = "The quick brown fox"
    ids = hf_tok.encode(prompt)
    r = post(live, "/v1/completions", prompt=prompt, max_tokens=2, n=2, prompt_logprobs=2)
    assert r.status_code == 200
    choices = r.json()["choices"]
    t1, t2, t3 = ids[1:4]
    # written out for the first three positions: rank 2 (inside the top 2), rank 3 (outside), rank 1
    assert choices[0]["prompt_logprobs"][:4] == [
        None,
        {
            str(t1): {"logprob": -1.5, "rank": 2, "decoded_token": hf_tok.decode([t1])},
            str((t1 + 1) % 256): {"logprob": -1.25, "rank": 1, "decoded_token": hf_tok.decode([(t1 + 1) % 256])},
        },
        {
            str(t2): {"logprob": -2.0, "rank": 3, "decoded_token": hf_tok.decode([t2])},
            str((t2 + 1) % 256): {"logprob": -1.5, "rank": 1, "decoded_token": hf_tok.decode([(t2 + 1) % 256])},
            str((t2 + 2) % 256): {"logprob": -1.75, "rank": 2, "decoded_token": hf_tok.decode([(t2 + 2) % 256])},
        },
        {
            str(t3): {"logprob": -2.5, "rank": 1, "decoded_token": hf_tok.decode([t3])},
            str((t3 + 2) % 256): {"logprob": -2.75, "rank": 2, "decoded_token": hf_tok.decode([(t3 + 2) % 256])},
        },
    ]
    for c in choices:  # every choice carries its prompt's; the text is not echoed, no logprobs asked
        assert c["prompt_logprobs"] == expected_prompt_logprobs(hf_tok, ids, 2)
        assert c["text"] == hf_tok.decode(backend.output_ids[:2]) and c["logprobs"] is None
    assert [r.sampling.prompt_logprobs for r in backend.received] == [2]


def test_prompt_logprobs_zero_holds_just_the_prompt_token(live, backend, hf_tok):
    ids = hf_tok.encode("Hello world")
    r = post(live, "/v1/completions", prompt=ids, max_tokens=1, prompt_logprobs=0)
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got == [None] + [
        {str(t): {"logprob": prompt_logprob(p), "rank": prompt_rank(p), "decoded_token": hf_tok.decode([t])}}
        for p, t in enumerate(ids)
        if p > 0
    ]


def test_prompt_logprobs_and_echo_logprobs_each_keep_their_own_top(live, backend, hf_tok):
    ids = hf_tok.encode("Hello world")
    r = post(live, "/v1/completions", prompt="Hello world", max_tokens=2, echo=True, logprobs=1, prompt_logprobs=3)
    choice = r.json()["choices"][0]
    assert backend.received[0].sampling.prompt_logprobs == 3  # one computation serves both
    assert choice["logprobs"] == expected_logprobs(hf_tok, ids, backend.output_ids[:2], 1)
    assert choice["prompt_logprobs"] == expected_prompt_logprobs(hf_tok, ids, 3)


def test_prompt_logprobs_on_chat_sit_at_the_top_level(live, backend, hf_tok):
    messages = [{"role": "user", "content": "Hello there!"}]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    r = post(live, "/v1/chat/completions", messages=messages, max_tokens=3, n=2, prompt_logprobs=1)
    body = r.json()
    assert body["prompt_logprobs"] == expected_prompt_logprobs(hf_tok, ids, 1)
    assert len(body["prompt_logprobs"]) == len(ids) == body["usage"]["prompt_tokens"]
    assert all("prompt_logprobs" not in c and c["logprobs"] is None for c in body["choices"])
    assert [c["message"]["content"] for c in body["choices"]] == [hf_tok.decode(backend.output_ids[:3])] * 2


def test_no_prompt_logprobs_field_unless_asked(live, backend):
    completion = post(live, "/v1/completions", prompt="Hello", max_tokens=1, logprobs=1).json()
    chat = post(live, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=1).json()
    assert "prompt_logprobs" not in completion["choices"][0] and "prompt_logprobs" not in chat
    assert [r.sampling.prompt_logprobs for r in backend.received] == [None, None]


def test_missing_prompt_logprobs_from_the_backend_fail_the_request(live, backend, monkeypatch):
    monkeypatch.setattr(backend, "_prompt_logprobs", lambda prompt, k: [])  # a worker that forgot them
    r = post(live, "/v1/completions", prompt="Hello world", max_tokens=2, prompt_logprobs=1)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "generation_failed"
    assert "prompt logprobs" in r.json()["error"]["message"]


# --- refusals --------------------------------------------------------------------------------------------


def _assert_400(r: httpx.Response, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert message in err["message"], err["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_prompt_logprobs_with_stream_is_400(live, backend, path, body):
    r = post(live, path, **body, max_tokens=1, stream=True, prompt_logprobs=1)
    _assert_400(r, "prompt_logprobs", "prompt_logprobs is not available when stream is true")
    assert backend.received == []


@pytest.mark.parametrize("value", [21, -1, "2", True, 1.5])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_prompt_logprobs_out_of_range_is_400(live, backend, path, body, value):
    r = post(live, path, **body, max_tokens=1, prompt_logprobs=value)
    _assert_400(r, "prompt_logprobs", f"prompt_logprobs must be an integer in [0, 20], got {value!r}")
    assert backend.received == []


@pytest.mark.parametrize("last_role, echoed", [("assistant", "It is"), ("user", "")])
def test_chat_echo_leads_with_the_assistant_message_it_continues(live, backend, hf_tok, last_role, echoed):
    """vLLM's chat echo: the reply starts with the last message's content where that message is the
    assistant's (an answer the client began, continued with continue_final_message); else nothing."""
    messages = [{"role": "user", "content": "x"}, {"role": last_role, "content": "It is"}]
    extra = dict(continue_final_message=True, add_generation_prompt=False) if last_role == "assistant" else {}
    generated = hf_tok.decode(backend.output_ids[:5], skip_special_tokens=True)
    r = post(live, "/v1/chat/completions", messages=messages, max_tokens=5, echo=True, **extra)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == echoed + generated
    chunks = stream(live, "/v1/chat/completions", messages=messages, max_tokens=5, echo=True, logprobs=True, **extra)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": echoed}
    assert "".join(d.get("content") or "" for d in deltas) == echoed + generated
    assert backend.received[-1].sampling.prompt_logprobs is None  # chat echo asks no prompt logprobs
    r = post(live, "/v1/chat/completions", messages=messages, max_tokens=5, echo=False, **extra)
    assert r.json()["choices"][0]["message"]["content"] == generated


def test_suffix_is_still_refused_with_echo(live, backend):
    _assert_400(
        post(live, "/v1/completions", prompt="Hello", max_tokens=1, echo=True, suffix="!"),
        "suffix",
        "suffix is not supported",
    )
