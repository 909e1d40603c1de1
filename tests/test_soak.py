"""The soak of issue 9, bounded for CI: 8 concurrent streams for 2 minutes against ``pdserve serve``
(1 prefill + 1 decode). ``python -m tests.soak --minutes M`` runs it longer; criteria in tests/soak.py."""

from __future__ import annotations

import pytest

from tests.soak import P99_RATIO_MAX, RSS_GROWTH_MAX, run_soak


@pytest.mark.slow
def test_two_minute_soak_has_no_error_no_drift_and_no_growth():
    result = run_soak(minutes=2.0, concurrency=8)
    assert result.errors == 0, result.error_samples
    assert result.requests > 100 and result.checked_requests >= result.requests // 2 - 1  # the load really ran
    p99 = result.latency_p99_s
    assert p99["last_quarter"] <= P99_RATIO_MAX * p99["first_quarter"], p99
    for name, rss in result.rss_kb.items():
        assert rss["end"] < (1 + RSS_GROWTH_MAX) * rss["start"], (name, rss)
    for name, fds in result.fds.items():
        assert fds["end"] <= fds["start"], (name, fds)
    assert set(result.rss_kb) == set(result.fds) == {"gateway", "prefill-0", "decode-0"}
    assert result.idle_ok, "workers not idle (kv_blocks_in_use == 0, integrity checked) after the soak"
    assert result.failures == [] and result.verdict == "pass"
