"""Hostile HTTP input against a real ``pdserve serve`` gateway: every request gets a 4xx OpenAI error
(never a 5xx, a stack trace or a hang) and the gateway keeps serving. Two halves:

- hand-written cases (huge, deep, undecodable, out-of-range, enormous prompts, thousands of stop
  strings, wrong content types), each with the exact status and error field it must produce;
- schemathesis generating bodies from the gateway's own /openapi.json, valid and invalid, checked
  for "no server error" under a per-request timeout (bounded examples: well under a minute)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

MODEL = str(tiny_model_dir("llama"))
CONTEXT = 64  # small, so that every valid generated request is short
MAX_BODY = 1 << 20
JSON = {"content-type": "application/json"}
MAX_SECONDS = 10.0  # what "no hang" means for one rejected request


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("cluster"),
        model={"max_model_len": CONTEXT},
        engine={"block_size": 16, "kv_cache_memory_mb": 16},
        gateway={"max_body_bytes": MAX_BODY},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, **fields}).encode()


def _chunks(total: int, size: int = 64 << 10):
    for _ in range(total // size):
        yield b"x" * size


# (case id, path, raw body or a function making it, headers, expected status, expected "param" or None)
CASES = [
    ("huge body", "/v1/completions", b"x" * (4 * MAX_BODY), JSON, 413, None),
    ("huge prompt string", "/v1/completions", body(prompt="a" * (2 * MAX_BODY)), JSON, 413, None),
    ("huge chunked body", "/v1/completions", lambda: _chunks(4 * MAX_BODY), JSON, 413, None),
    ("deep JSON nesting", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, 400, None),
    ("deep unclosed nesting", "/v1/chat/completions", b'{"messages": ' + b'{"a":' * 50_000, JSON, 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}', JSON, 400, None),
    ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', JSON, 400, None),
    ("empty body", "/v1/completions", b"", JSON, 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2, 3]", JSON, 400, None),
    ("negative max_tokens", "/v1/completions", body(prompt="hi", max_tokens=-5), JSON, 400, "max_tokens"),
    ("enormous max_tokens", "/v1/completions", body(prompt="hi", max_tokens=10**30), JSON, 400, "max_tokens"),
    ("enormous n", "/v1/completions", body(prompt="hi", n=10**20), JSON, 400, "n"),
    ("enormous seed", "/v1/completions", body(prompt="hi", seed=2**70), JSON, 400, "seed"),
    (
        "very negative seed",
        "/v1/chat/completions",
        body(messages=[{"role": "user", "content": "x"}], seed=-(2**70)),
        JSON,
        400,
        "seed",
    ),
    ("enormous top_k", "/v1/completions", body(prompt="hi", top_k=10**20), JSON, 400, "top_k"),
    ("enormous temperature", "/v1/completions", body(prompt="hi", temperature=1e308), JSON, 400, "temperature"),
    (
        "enormous repetition_penalty",
        "/v1/completions",
        body(prompt="hi", repetition_penalty=1e300),
        JSON,
        400,
        "repetition_penalty",
    ),
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', JSON, 400, "temperature"),
    ("-Infinity top_p", "/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', JSON, 400, "top_p"),
    (
        "enormous stop token id",
        "/v1/completions",
        body(prompt="hi", stop_token_ids=[10**20]),
        JSON,
        400,
        "stop_token_ids",
    ),
    ("negative token id", "/v1/completions", body(prompt=[-1, 5]), JSON, 400, "prompt"),
    ("enormous token id", "/v1/completions", body(prompt=[2**64]), JSON, 400, "prompt"),
    ("1e5-token id prompt", "/v1/completions", body(prompt=[7] * 100_000), JSON, 400, "prompt"),
    ("1e5-token text prompt", "/v1/completions", body(prompt="hello " * 100_000), JSON, 400, "prompt"),
    (
        "1e5-token chat prompt",
        "/v1/chat/completions",
        body(messages=[{"role": "user", "content": "hello " * 100_000}]),
        JSON,
        400,
        "messages",
    ),
    ("thousands of stop strings", "/v1/completions", body(prompt="hi", stop=["s"] * 5000), JSON, 400, "stop"),
    ("stop of wrong type", "/v1/completions", body(prompt="hi", stop=[1, 2]), JSON, 400, "stop"),
    ("boolean as integer", "/v1/completions", body(prompt="hi", max_tokens=True), JSON, 400, "max_tokens"),
    ("text/plain JSON", "/v1/completions", body(prompt="hi"), {"content-type": "text/plain"}, 415, None),
    (
        "form post",
        "/v1/chat/completions",
        b"messages=x",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        None,
    ),
    (
        "multipart",
        "/v1/completions",
        b"--b\r\n\r\nx\r\n--b--",
        {"content-type": "multipart/form-data; boundary=b"},
        415,
        None,
    ),
    ("detokenize strings", "/detokenize", json.dumps({"tokens": ["a", None]}).encode(), JSON, 400, "tokens"),
    ("detokenize enormous id", "/detokenize", json.dumps({"tokens": [2**64]}).encode(), JSON, 400, "tokens"),
    ("tokenize a number", "/tokenize", json.dumps({"prompt": 5}).encode(), JSON, 400, "prompt"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 1000
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_4xx_error_json(cluster, case):
    _, path, content, headers, status, param = case
    content = content() if callable(content) else content  # a generator (chunked upload) is made per run
    started = time.monotonic()
    response = httpx.post(cluster.url + path, content=content, headers=headers, timeout=30)
    assert time.monotonic() - started < MAX_SECONDS
    assert_openai_error(response, status, param)


def test_wrong_method_and_unknown_route_are_4xx_json(cluster):
    assert_openai_error(httpx.get(cluster.url + "/v1/completions"), 405, None)
    assert_openai_error(httpx.post(cluster.url + "/v1/nothing-here", content=b"{}"), 404, None)


def test_gateway_keeps_serving_after_hostile_input(cluster):
    """Runs after the hostile cases (file order): a normal request completes and nothing is left held."""
    response = httpx.post(
        cluster.url + "/v1/completions", content=body(prompt="Once upon", ignore_eos=True), headers=JSON, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(cluster.url + "/health").status_code == 200
    cluster.wait_idle()


def test_schemathesis_no_server_error_no_hang(cluster):
    """Every operation of /openapi.json, valid (positive) and schema-violating (negative) bodies."""
    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    num_calls = 0
    for op in operations:
        # without a body or a query there is nothing to violate (a path's string id is any string)
        violable = len(op.body) > 0 or len(op.query) > 0
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if violable else (GenerationMode.POSITIVE,)
        for mode in modes:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=12 if violable else 2,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def check(case):
                nonlocal num_calls
                num_calls += 1
                started = time.monotonic()
                response = case.call(timeout=30)
                assert time.monotonic() - started < 30
                assert response.status_code < 500 or (case.path == "/ready" and response.status_code == 503), (
                    f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} {response.text[:300]}"
                )
                if response.status_code >= 400 and case.path != "/ready":
                    if case.path.startswith("/v1/messages"):  # Anthropic's error JSON on its routes
                        assert response.json()["type"] == "error" and set(response.json()["error"]) == {
                            "type",
                            "message",
                        }
                    else:
                        assert set(response.json()["error"]) == {"message", "type", "param", "code"}

            check()
    assert num_calls >= 100
    cluster.wait_idle()
