"""benchmarks.transfer.pd_parity on CPU (shm between the workers): every series it reads exists under
the name the workers and the gateway export, one TTFT and one transfer per request, and the prefill
worker's copy, exposed tail and span add up. A missing series is an error that names it."""

from __future__ import annotations

import json

import pytest

from benchmarks.common.client import parse_metric
from benchmarks.common.metric_text import MissingMetric, metric_sums
from benchmarks.transfer import pd_parity
from tests.model_factory import tiny_model_dir

BODY = (
    "# HELP vllm:time_to_first_token_seconds x\n# TYPE vllm:time_to_first_token_seconds histogram\n"
    'vllm:time_to_first_token_seconds_count{model_name="m"} 3.0\n'
    'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
)


def test_a_missing_metric_is_an_error_naming_it():
    assert metric_sums(BODY, {"vllm:time_to_first_token_seconds_count"}) == {
        "vllm:time_to_first_token_seconds_count": 3.0
    }
    with pytest.raises(MissingMetric, match="pdserve:time_to_first_token_seconds_count") as caught:
        metric_sums(BODY, {"pdserve:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum"})
    assert caught.value.names == ["pdserve:time_to_first_token_seconds_count"]
    with pytest.raises(MissingMetric, match="pdserve:kv_live_slots"):
        parse_metric(BODY, "pdserve:kv_live_slots")


def test_a_label_selector_sums_the_matching_samples_and_an_unseen_label_set_is_zero():
    body = (
        "# HELP pdserve:requests x\n# TYPE pdserve:requests counter\n"
        'pdserve:requests_total{model="m",outcome="success"} 4.0\n'
        'pdserve:requests_total{model="n",outcome="success"} 2.0\n'
        'pdserve:requests_total{model="m",outcome="failed"} 1.0\n'
    )
    assert parse_metric(body, "pdserve:requests_total") == 7.0
    assert parse_metric(body, 'pdserve:requests_total{outcome="success"}') == 6.0
    assert parse_metric(body, 'pdserve:requests_total{model="m",outcome="failed"}') == 1.0
    assert parse_metric(body, 'pdserve:requests_total{outcome="aborted"}') == 0.0  # exported from its first count
    with pytest.raises(MissingMetric, match="pdserve:request_failures_total"):
        parse_metric(body, 'pdserve:request_failures_total{reason="aborted"}')


def test_counts_other_than_one_per_request_fail_the_run():
    figures = {"requests": 3, "ttft_count": 0.0, "transfers": 3.0, "transfers_sent": 3.0}
    assert pd_parity.check_counts(figures) == ["ttft_count=0, expected 3"]


def test_cpu_pd_run_reports_ttft_and_transfer_timing(tmp_path):
    out = tmp_path / "pd.json"
    model = tiny_model_dir("llama")
    rc = pd_parity.main(["--device", "cpu", "--quick", "--model", str(model), "--json", str(out)])
    figures = json.loads(out.read_text())
    assert rc == 0, figures
    n = figures["requests"]
    assert figures["equal"] == n and figures["transports"] == ["shm"]
    assert figures["ttft_count"] == n and figures["transfers"] == n and figures["transfers_sent"] == n
    assert figures["count_errors"] == []
    # The sender copied what the receiver counted, and the copy and the tail fit inside the span.
    assert figures["copied_bytes"] == figures["transfer_bytes"] > 0
    assert 0 < figures["copy_seconds"] < figures["span_seconds"]
    assert 0 < figures["exposed_seconds"] <= figures["span_seconds"]
    # Not bounded by 1: the gateway streams the first token from the prefill worker, so the tail after
    # the commit can outlast TTFT (it delays the second token instead); the share is a ratio of sums.
    assert figures["exposed_share_of_ttft"] == pytest.approx(figures["exposed_seconds"] / figures["ttft_seconds"])
