"""Bounds on request fields a body cap alone does not make safe (gateway/http/request_fields.py): a
logit_bias key of thousands of digits (int() raises past 4,300 digits: it was a 500 with a traceback),
too many biased tokens, overlong stop strings. Each is a 400 naming the field and the limit, with a
bounded message."""

from __future__ import annotations

import pytest

from gateway.http.errors import APIError
from gateway.http.request_fields import MAX_LOGIT_BIAS_KEYS, MAX_STOP_CHARS, Fields
from gateway.text.tool_calls import MAX_TOOLS, parse_tools


def refusal(body: dict, read) -> APIError:
    with pytest.raises(APIError) as info:
        read(Fields(body))
    assert info.value.status == 400 and len(str(info.value)) < 400
    return info.value


@pytest.mark.parametrize("digits", [20, 4301, 100_000])
def test_a_logit_bias_key_longer_than_an_int64_is_400(digits):
    err = refusal({"logit_bias": {"9" * digits: 1}}, lambda f: f.logit_bias("logit_bias", 100))
    assert "logit_bias keys must be token ids (non-negative integers)" in str(err)


def test_the_largest_int64_key_still_reads():
    key = str((1 << 63) - 1)
    assert Fields({"logit_bias": {key: 1.5}}).logit_bias("logit_bias", 100) == {(1 << 63) - 1: 1.5}


def test_too_many_logit_bias_keys_is_400_with_the_limit():
    body = {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_KEYS + 1)}}
    err = refusal(body, lambda f: f.logit_bias("logit_bias", 100))
    assert str(err) == f"logit_bias may bias at most {MAX_LOGIT_BIAS_KEYS} tokens, got {MAX_LOGIT_BIAS_KEYS + 1}"
    within = {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_KEYS)}}
    assert len(Fields(within).logit_bias("logit_bias", 100)) == MAX_LOGIT_BIAS_KEYS


def test_a_stop_string_over_the_bound_is_400_and_one_at_it_reads():
    err = refusal({"stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]}, lambda f: f.stop_strings())
    assert f"at most {MAX_STOP_CHARS} characters, got {MAX_STOP_CHARS + 1}" in str(err)
    assert Fields({"stop": "y" * MAX_STOP_CHARS}).stop_strings() == ["y" * MAX_STOP_CHARS]


def test_more_tools_than_openai_allows_is_400():
    """(Beyond the test gateway's body cap, so read here; tests/test_gateway_errors.py has the name bound.)"""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(MAX_TOOLS + 1)]
    with pytest.raises(APIError) as info:
        parse_tools(tools)
    assert info.value.status == 400 and str(info.value) == f"tools may list at most {MAX_TOOLS} functions, got 129"
    assert parse_tools(tools[:MAX_TOOLS]) == tools[:MAX_TOOLS]
