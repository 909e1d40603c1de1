"""The CI subset of the chaos tool (``python -m tests.chaos`` runs all of it): a decode worker killed
while KV streams into it, the gateway killed while requests decode, and a prefill worker cut off the
network mid-prefill, each under a steady load against a 2 prefill + 2 decode cluster, and a key
holder forging frames for requests in flight (a hostile scenario, tests/chaos/hostile.py). The same
scenario code as the tool asserts the same invariants: no request hangs or comes back different from the single
engine's greedy output, errors are clear, the cluster recovers and picks the replacement up, no KV
block leaks and every worker's integrity check passes."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.chaos.__main__ import run_all
from tests.chaos.clusters import BLOCK, ServeCluster
from tests.chaos.hostile import HostileCluster, HostileResult, run_attack, warm_up
from tests.chaos.hostile_store import STORE_ATTACKS, StoreCluster
from tests.chaos.load import make_prompts
from tests.chaos.report import chaos_table, hostile_table, write_report
from tests.chaos.scenario import RunResult, Scenario, run_once
from tests.model_factory import tiny_model_dir

ON_SERVE = [
    Scenario("sigkill", "decode", "transferring"),
    Scenario("sigkill", "gateway", "decoding"),
    Scenario("sigstop", "gateway", "queued"),  # a stalled gateway must hear its workers again when it wakes
]
LINK_DOWN = Scenario("linkdown", "prefill", "prefilling")


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(str(tiny_model_dir("llama")), BLOCK, 64)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    cluster = ServeCluster(str(tiny_model_dir("llama")), tmp_path_factory.mktemp("chaos"))
    yield cluster
    cluster.close()


def assert_survived(result: RunResult) -> None:
    assert result.failures == [], result.failures
    assert result.outcomes["ok"] > 0 and result.recover_s is not None and result.leaked_blocks == 0


@pytest.mark.parametrize("scenario", ON_SERVE, ids=lambda s: s.name.replace(" ", "-"))
def test_fault_under_load_on_pdserve_serve(serve, prompts, scenario):
    result = run_once(serve, scenario, prompts, run=1)  # run 1: the second worker of the pool
    assert_survived(result)
    if (
        scenario.fault == "sigkill" and scenario.target == "gateway"
    ):  # clients saw it go: refused or reset, never a hang
        assert result.outcomes["disconnected"] > 0


def test_link_down_of_a_prefill_worker_in_namespaces(prompts):
    litter = set(Path(tempfile.gettempdir()).glob("chaos-*"))
    results, not_run = run_all([LINK_DOWN], runs=1, prompts=prompts)
    assert set(Path(tempfile.gettempdir()).glob("chaos-*")) == litter  # logs are kept for failed runs only
    if not_run:  # only where namespaces cannot be made, and the report says why instead of faking it
        assert os.geteuid() != 0 or os.environ.get("MULTIHOST_LOOPBACK"), not_run
        assert not_run[LINK_DOWN].startswith("no network namespaces: ")
        return
    [result] = results
    assert result.member == "prefill-0"
    assert_survived(result)


def test_a_key_holder_forging_frames_under_load_is_refused_and_every_request_is_exact(prompts, tmp_path):
    """The CI subset of the hostile scenarios: forged token events, KV writes, commits and aborts for
    requests in flight, by a key holder that was not given them."""
    cluster = HostileCluster(str(tiny_model_dir("llama")), tmp_path)
    try:
        warm_up(cluster, prompts)
        result = run_attack(cluster, "forged token events and KV writes", prompts)
    finally:
        cluster.close()
    assert result.failures == [], result.failures
    # at least one forged frame met its request still in flight (one that lands after it ended is stale)
    assert result.sent == 15 and result.refused["not_assigned"] >= 1
    assert result.outcomes["ok"] == sum(result.outcomes.values()) > 0 and result.leaked_blocks == 0


def test_the_responses_store_under_load_refuses_a_redis_stranger_and_another_tenant(prompts, tmp_path):
    """The Responses store's attacks (tests/chaos/hostile_store.py): Redis without the password from a
    worker's position, and another API key's reads of a stored response, each refused under load."""
    cluster = StoreCluster(str(tiny_model_dir("llama")), tmp_path)
    try:
        warm_up(cluster, prompts)
        results = [run_attack(cluster, name, prompts, STORE_ATTACKS) for name in STORE_ATTACKS]
    finally:
        cluster.close()
    redis_read, cross_tenant = results
    assert [r.failures for r in results] == [[], []]
    assert redis_read.sent == 4 and redis_read.refused["redis_auth"] == 4
    assert cross_tenant.sent == 5 and cross_tenant.refused["not_found"] == 5
    for r in results:
        assert r.outcomes["ok"] == sum(r.outcomes.values()) > 0 and r.leaked_blocks == 0


def test_report_rows_count_outcomes_and_failures():
    kill, stop, link = Scenario("sigkill", "decode", "queued"), Scenario("sigstop", "gateway", "decoding"), LINK_DOWN
    results = [
        RunResult(kill, "decode-0", Counter(ok=9, error=2), [], 10.0, 0),
        RunResult(kill, "decode-1", Counter(ok=5, hung=1), ["request hung: no answer"], 14.0, 3),
    ]
    rows = chaos_table([kill, stop, link], results, {link: "no network namespaces: not root"})
    assert rows[2:] == [
        "| sigkill decode @ queued (decode-0, decode-1) | 2 | 17 (14 exact, 2 clear error, 1 FAILED) | "
        "**FAIL** (1): decode-1: request hung: no answer | 12.0 (max 14.0) | 3 |",
        "| linkdown prefill @ prefilling | 0 | — | not run (no network namespaces: not root) | — | — |",
    ]


def test_hostile_rows_count_refusals_requests_and_leaks():
    results = [
        HostileResult("identity takeover", 2, Counter(identity_taken=1), Counter(ok=22), 0, 0, []),
        HostileResult(
            "client that never reads", 1, Counter(), Counter(ok=30, error=1), 3, 5, ["file descriptors grew by 5"]
        ),
    ]
    assert hostile_table(results)[2:] == [
        "| identity takeover | 2 | identity_taken 1 | 22 / 22 | 0 | +0 | pass |",
        "| client that never reads | 1 | — | 30 / 31 (1 clear error) | 3 | +5 | **FAIL** (1): file descriptors grew by 5 |",
    ]


def test_a_section_left_out_of_a_run_is_kept_with_the_run_that_wrote_it(tmp_path):
    report = tmp_path / "reliability.md"
    report.write_text(
        "# Reliability\n\n- command: `python -m tests.chaos` (1.0 min)\n- date: 2026-01-01 00:00 UTC, commit abc\n\n"
        "## Chaos\n\n| a table |\n\n## Soak\n\nsoak\n\n## A note by hand\n\nkept\n"
    )
    write_report(report, "python -m tests.chaos --scenarios none", [], [], {}, 60.0, hostile=[])
    text = report.read_text()
    assert "## Chaos\n\n*Kept from the run of `python -m tests.chaos` (1.0 min) on 2026-01-01 00:00 UTC" in text
    assert "| a table |" in text and "## Hostile peers under load" in text
    assert text.rstrip().endswith("## A note by hand\n\nkept")
