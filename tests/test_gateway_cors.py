"""CORS, as vLLM's --allowed-origins: off by default (no CORS headers, so a page from another origin
cannot read an answer); with origins configured, a browser's preflight is answered before the key check
and the answers carry Access-Control-Allow-Origin for those origins only. Expectations are the Fetch
standard's headers on real HTTP responses."""

from __future__ import annotations

import httpx
import pytest

from configs.loader import load_config
from gateway.__main__ import overrides_of, parse_args
from tests.fake_backend import API_KEYS, MODEL, live_gateway, make_test_tokenizer

UI = "https://ui.example"
PREFLIGHT = {
    "Origin": UI,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("cors_tok"))


def test_with_origins_a_preflight_passes_without_a_key_and_answers_name_the_origin(tok_dir):
    with live_gateway(tok_dir, allowed_origins=[UI]) as server:
        url = server.base_url + "/v1/completions"
        pre = httpx.options(url, headers=PREFLIGHT)
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == UI
        assert {"POST", "GET", "DELETE"} <= set(pre.headers["access-control-allow-methods"].replace(" ", "").split(","))
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in pre.headers  # the key is a header, never a cookie
        answer = httpx.post(url, json=BODY, headers={**AUTH, "Origin": UI})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == UI
        refused = httpx.post(url, json=BODY, headers={"Origin": UI})  # CORS does not replace the key
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
        other = {"Origin": "https://evil.example"}
        assert httpx.options(url, headers={**PREFLIGHT, **other}).status_code == 400
        assert "access-control-allow-origin" not in httpx.post(url, json=BODY, headers={**AUTH, **other}).headers


def test_a_wildcard_allows_any_origin(tok_dir):
    with live_gateway(tok_dir, allowed_origins=["*"]) as server:
        answer = httpx.get(server.base_url + "/v1/models", headers={**AUTH, "Origin": "https://any.example"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


def test_without_origins_there_are_no_cors_headers_and_no_preflight(tok_dir):
    with live_gateway(tok_dir) as server:
        url = server.base_url + "/v1/completions"
        assert httpx.options(url, headers=PREFLIGHT).status_code == 405
        answer = httpx.post(url, json=BODY, headers={**AUTH, "Origin": UI})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_origins_come_from_the_flag_the_environment_or_yaml():
    args = parse_args(["--allowed-origins", UI, "http://localhost:3000"])
    assert load_config(env={}, overrides=overrides_of(args)).gateway.allowed_origins == [UI, "http://localhost:3000"]
    env = {"PDSERVE_GATEWAY_ALLOWED_ORIGINS": f"{UI},http://localhost:3000"}
    assert load_config(env=env).gateway.allowed_origins == [UI, "http://localhost:3000"]
    assert load_config(env={}).gateway.allowed_origins == []
