"""Per-request resource bounds of the gateway, over a live gateway on a fake backend: each refusal is a
400 in OpenAI's error shape naming the limit, and nothing reaches the workers."""

from __future__ import annotations

import httpx
import pytest

from tests.fake_backend import API_KEYS, MODEL, live_gateway

HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}
PROMPT_LOGPROBS_BUDGET = 60


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(
        tok_dir, max_model_len=128, limits_given={"max_prompt_logprobs_entries": PROMPT_LOGPROBS_BUDGET}
    ) as server:
        yield server


def post(live, path: str, **body) -> httpx.Response:
    return httpx.post(live.base_url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=30)


def test_prompt_logprobs_within_the_budget_are_served(live, backend):
    prompt = list(range(10, 20))  # 9 tokens with logprobs x (2 + 1) x n=2 = 54 <= 60
    r = post(live, "/v1/completions", prompt=prompt, max_tokens=1, n=2, prompt_logprobs=2)
    assert r.status_code == 200
    assert [len(c["prompt_logprobs"]) for c in r.json()["choices"]] == [10, 10]


@pytest.mark.parametrize(
    "asked, param", [({"prompt_logprobs": 3}, "prompt_logprobs"), ({"echo": True, "logprobs": 3}, "logprobs")]
)
def test_prompt_logprobs_past_the_budget_are_a_400_naming_it(live, backend, asked, param):
    r = post(live, "/v1/completions", prompt=list(range(10, 20)), max_tokens=1, n=2, **asked)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": f"{param}: 9 prompt tokens with logprobs x (3 + 1) x n=2 is 72 entries, more than this "
            "server's limit of 60 (gateway.max_prompt_logprobs_entries)",
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
    }
    assert backend.received == []


def test_the_budget_counts_every_prompt_of_a_batch(live, backend):
    # two prompts of 6 tokens: 2 x 5 x (5 + 1) = 60 fits; a third would not
    assert post(live, "/v1/completions", prompt=[[5] * 6] * 2, max_tokens=1, prompt_logprobs=5).status_code == 200
    r = post(live, "/v1/completions", prompt=[[5] * 6] * 3, max_tokens=1, prompt_logprobs=5)
    assert (
        r.status_code == 400
        and "15 prompt tokens with logprobs x (5 + 1) x n=1 is 90 entries" in r.json()["error"]["message"]
    )
