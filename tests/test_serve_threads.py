"""``pdserve serve``'s threads: with one prefill worker beside one decode worker, the decode worker's steps
take the prefill worker's threads while none of its prompts is out (decode_node/step_threads.py; the
steps themselves: tests/test_decode_node.py)."""

from __future__ import annotations

from cluster.local_cluster import ClusterSpec, worker_argv
from cluster.serve import idle_prefill_threads


def test_one_prefill_worker_beside_one_decode_worker_lends_it_its_threads():
    # Only then does the prefill worker work for that decode worker alone (decode_node/step_threads.py).
    assert idle_prefill_threads(1, 1, 4) == 4
    assert [idle_prefill_threads(p, d, 4) for p, d in [(0, 1), (2, 1), (1, 2), (2, 2)]] == [0, 0, 0, 0]
    spec = ClusterSpec(None, {}, num_prefill=1, num_decode=1, threads_per_worker=2, decode_idle_prefill_threads=2)
    assert "decode.idle_prefill_threads=2" in worker_argv("decode", 0, spec)
    assert not any("idle_prefill_threads" in arg for arg in worker_argv("prefill", 0, spec))
    alone = ClusterSpec(None, {}, num_prefill=2, num_decode=1, threads_per_worker=1)
    assert not any("idle_prefill_threads" in arg for arg in worker_argv("decode", 0, alone))
