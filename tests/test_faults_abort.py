"""Abort at every phase of a request — queued, prefilling, transferring, decoding — with real processes
(``pdserve serve``: gateway + prefill + decode on loopback). The client hangs up; the gateway aborts the
request on both workers; each ends holding no KV block. A worker is frozen with SIGSTOP to hold the
request in the phase under test (its last heartbeat, seen at the gateway, names the phase)."""

from __future__ import annotations

import signal

import pytest
import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import RawStream, ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
CHUNK = 4  # many prefill steps per prompt: time to catch a prompt mid-prefill
LONG = 2000  # 500 prefill steps


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("faults-abort"),
        engine={"block_size": BLOCK, "prefill_chunk_size": CHUNK, "kv_cache_memory_mb": 8, "max_num_seqs": 1},
        gateway={"local_prefill_max_tokens": 0},
        transfer={"transport": "zmq"},
    )
    yield serve
    for worker in ("prefill-0", "decode-0"):  # never leave a frozen worker behind a failed test
        serve.signal(worker, signal.SIGCONT)
    assert serve.stop() == 0, "".join(serve.log[-30:])


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def body(prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": str(tiny_model_dir("llama")),
        "prompt": [prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def aborted(cluster, worker: str) -> float:
    if worker.startswith("prefill"):
        return cluster.metric(worker, "pdserve:prefill_jobs_aborted_total")
    return cluster.metric(worker, 'pdserve:request_failure_total{reason="aborted"}')


def running(cluster, worker: str) -> float:
    return cluster.metric(worker, "vllm:num_requests_running")


def check_still_exact(cluster) -> None:
    """The cluster serves on afterwards, token for token like the single engine."""
    import httpx

    prompt = prompt_of(3 * BLOCK + 5, seed=11)
    reply = httpx.post(f"{cluster.url}/v1/completions", json=body(prompt, 8), timeout=120).json()
    llm = LLM(str(tiny_model_dir("llama")), block_size=BLOCK)
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert reply["choices"][0]["text"] == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_abort_while_queued_and_while_prefilling(cluster):
    p_before, d_before = aborted(cluster, "prefill-0"), aborted(cluster, "decode-0")
    computed_before = cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    long = RawStream(cluster.url, body(prompt_of(LONG, seed=1), 4))  # holds P's only slot (max_num_seqs 1)
    cluster.wait_until(lambda: running(cluster, "prefill-0") == 1, "P prefilling")
    queued = RawStream(cluster.url, body(prompt_of(40, seed=2), 4))
    cluster.wait_until(
        lambda: cluster.metric("prefill-0", "vllm:num_requests_waiting") == 1, "the second job queued on P"
    )
    cluster.signal("prefill-0", signal.SIGSTOP)  # freeze both phases
    try:
        long.hang_up()
        queued.hang_up()
        # D drops both at once (its reservations, the receiver's ranges) while P is still frozen.
        cluster.wait_until(lambda: aborted(cluster, "decode-0") - d_before == 2, "D aborted both")
        # (/metrics is read on another thread: the gauges follow within one loop turn)
        cluster.wait_until(lambda: cluster.metric("decode-0", "pdserve:kv_blocks_in_use") == 0, "D freed", 5)
        assert cluster.metric("decode-0", "pdserve:kv_blocks_held_for_peer") == 0
    finally:
        cluster.signal("prefill-0", signal.SIGCONT)
    cluster.wait_until(lambda: aborted(cluster, "prefill-0") - p_before == 2, "P aborted both jobs")
    cluster.wait_idle()
    assert cluster.metric("prefill-0", "pdserve:kv_blocks_in_use") == 0
    # The long prompt was cut off mid-prefill and the queued one never started.
    assert cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total") - computed_before < LONG
    check_still_exact(cluster)


def test_abort_while_transferring(cluster):
    p_before, d_before = aborted(cluster, "prefill-0"), aborted(cluster, "decode-0")
    computed_before = cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    # The longest prompt, so D is frozen while P still computes it, however fast this machine prefills
    # (a 400-token prompt finished between two of the test's polls, and D took its KV).
    length = LONG
    stream = RawStream(cluster.url, body(prompt_of(length, seed=3), 4))
    cluster.wait_until(lambda: running(cluster, "prefill-0") == 1, "P prefilling")
    cluster.signal("decode-0", signal.SIGSTOP)  # nobody acknowledges the KV: P stays transferring
    try:
        cluster.wait_until(
            lambda: cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total") - computed_before == length,
            "P computed the prompt",
        )
        stream.read_until(b'"text"')  # P streamed the first token through the gateway (TTFT)
        assert cluster.metric("prefill-0", "pdserve:kv_blocks_in_use") > 0  # pinned for the transfer
        stream.hang_up()
        # The gateway aborts on P too: P lets go of its pinned blocks while D is still frozen.
        cluster.wait_until(lambda: aborted(cluster, "prefill-0") - p_before == 1, "P aborted the transfer")
        cluster.wait_until(lambda: cluster.metric("prefill-0", "pdserve:kv_blocks_in_use") == 0, "P freed")
    finally:
        cluster.signal("decode-0", signal.SIGCONT)
    cluster.wait_until(lambda: aborted(cluster, "decode-0") - d_before == 1, "D aborted")
    cluster.wait_idle()
    assert cluster.metric("decode-0", "pdserve:kv_blocks_held_for_peer") == 0
    check_still_exact(cluster)


def test_abort_while_decoding(cluster):
    d_before = aborted(cluster, "decode-0")
    stream = RawStream(cluster.url, body(prompt_of(40, seed=4), 2000))
    stream.read_until(b"data:", count=4)  # P's first token and three of D's
    cluster.wait_until(lambda: running(cluster, "decode-0") == 1, "D decoding")
    stream.hang_up()
    cluster.wait_until(lambda: aborted(cluster, "decode-0") - d_before == 1, "D aborted")
    cluster.wait_idle()
    assert cluster.metric("prefill-0", "pdserve:kv_blocks_in_use") == 0
    assert cluster.metric("decode-0", "pdserve:kv_blocks_in_use") == 0
