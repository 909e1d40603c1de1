"""Workers killed or frozen mid-request, with real processes (``pdserve serve`` on loopback, the KV moving
over the ``shm`` transport that ``transfer.transport: auto`` picks on one host). Leases are short (2 s)
so every hold a dead peer leaves behind is cut within seconds; each test ends with both workers idle,
the supervisor having restarted what was killed and removed its /dev/shm files."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time

import httpx
import pytest
import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
CHUNK = 4  # many prefill steps: time to strike mid-prefill / mid-transfer
LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("faults-kill"),
        engine={"block_size": BLOCK, "prefill_chunk_size": CHUNK, "kv_cache_memory_mb": 8},
        # The gateway drops a silent worker only after 8 s: the workers' own leases act first.
        gateway={"local_prefill_max_tokens": 0, "worker_timeout_s": 8.0},
        transfer={"transport": "auto", "lease_seconds": LEASE_S},
    )
    decode_pids = set()
    yield serve, decode_pids
    for worker in ("prefill-0", "decode-0"):  # never leave a frozen worker behind a failed test
        with contextlib.suppress(ProcessLookupError):
            serve.signal(worker, signal.SIGCONT)
    decode_pids.add(serve.worker_pid["decode-0"])
    assert serve.stop() == 0, "".join(serve.log[-30:])
    for pid in decode_pids:  # a clean exit unlinks its files, the supervisor those of a killed one
        assert shm_files(pid) == []


@pytest.fixture(scope="module")
def reference():
    return LLM(str(tiny_model_dir("llama")), block_size=BLOCK)


def shm_files(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("pdserve-") and f"-{pid}-" in n)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_text(reference: LLM, prompt: list[int], max_tokens: int) -> str:
    [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return reference.tokenizer.decode(out.outputs[0].token_ids)


def complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=90,
        json={
            "model": str(tiny_model_dir("llama")),
            "prompt": [prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )


def exact_or_clear_error(response: httpx.Response, expected: str) -> str:
    """A request hit by a fault either succeeds exactly (retried) or fails with an OpenAI error body."""
    if response.status_code == 200:
        assert response.json()["choices"][0]["text"] == expected
        return "ok"
    error = response.json()["error"]
    assert response.status_code in (500, 502, 503, 504) and error["message"], response.text
    return error["message"]


def job_ended_early(serve: ServeProcess) -> float:
    """P's jobs aborted by a peer plus those failed by their transfer."""
    return serve.metric("prefill-0", "pdserve:prefill_jobs_aborted_total") + serve.metric(
        "prefill-0", 'pdserve:prefill_jobs_rejected_total{reason="transfer"}'
    )


def started_prefill(serve: ServeProcess, before: float) -> bool:
    return serve.metric("prefill-0", "pdserve:prefill_computed_tokens_total") > before


def test_shm_transport_is_used_on_one_host_and_output_is_exact(cluster, reference):
    serve, _ = cluster
    decode_pid = serve.worker_pid["decode-0"]
    assert [n.split("-")[1] for n in shm_files(decode_pid)] == ["fence", "kv"]  # D's pool and fence
    for length in (5, 3 * BLOCK, 5 * BLOCK + 3):
        prompt = prompt_of(length, seed=length)
        response = complete(serve.url, prompt, 10)
        assert response.json()["choices"][0]["text"] == expected_text(reference, prompt, 10)
    # Every transfer went over shm (the label on D's transfer metrics), none over zmq.
    assert serve.metric("decode-0", 'pdserve:kv_transfer_bytes_count{transport="shm"}') == 3
    assert serve.metric("decode-0", 'pdserve:kv_transfer_bytes_count{transport="zmq"}') == 0
    serve.wait_idle()


def test_sigkill_prefill_mid_transfer(cluster, reference):
    serve, _ = cluster
    prompt = prompt_of(800, seed=21)
    expected = expected_text(reference, prompt, 6)
    expired_before = serve.metric("decode-0", "pdserve:kv_lease_expired_total")
    computed_before = serve.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    incarnation = serve.registered("prefill-0")["incarnation"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, serve.url, prompt, 6)
        serve.wait_until(lambda: started_prefill(serve, computed_before), "P prefilling")
        assert serve.metric("decode-0", "pdserve:kv_blocks_held_for_peer") > 0  # D reserved the prompt's blocks
        serve.signal("prefill-0", signal.SIGKILL)
        killed_at = time.monotonic()
        # D gets its blocks back once the lease runs out (no more writes renew it).
        serve.wait_until(
            lambda: serve.metric("decode-0", "pdserve:kv_lease_expired_total") > expired_before,
            "D's lease to expire",
            timeout_s=LEASE_S + 10,
        )
        assert time.monotonic() - killed_at < LEASE_S + 10
        serve.wait_until(lambda: serve.metric("decode-0", "pdserve:kv_blocks_held_for_peer") == 0, "D freed", 5)
        exact_or_clear_error(future.result(timeout=90), expected)  # no hang
    serve.wait_restarted("prefill-0", incarnation)
    serve.wait_idle()
    response = complete(serve.url, prompt, 6)  # the restarted prefill worker serves again, exactly
    assert response.json()["choices"][0]["text"] == expected
    serve.wait_idle()


def test_sigkill_decode_mid_transfer(cluster, reference):
    serve, decode_pids = cluster
    prompt = prompt_of(800, seed=22)
    expected = expected_text(reference, prompt, 6)
    ended_before = job_ended_early(serve)
    computed_before = serve.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    incarnation = serve.registered("decode-0")["incarnation"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, serve.url, prompt, 6)
        serve.wait_until(lambda: started_prefill(serve, computed_before), "P prefilling")
        old_pid = serve.signal("decode-0", signal.SIGKILL)
        decode_pids.add(old_pid)
        # P pushes into a dead receiver: no credits come back, so the transfer deadline fails it (or
        # the gateway, seeing D gone, aborts the job first); either way P unpins every block.
        serve.wait_until(
            lambda: (
                serve.metric("prefill-0", "vllm:num_requests_running") == 0
                and serve.metric("prefill-0", "pdserve:kv_blocks_in_use") == 0
            ),
            "P holds nothing for D",
            timeout_s=LEASE_S + 15,
        )
        exact_or_clear_error(future.result(timeout=90), expected)  # no hang
    # The job was cut, never committed (the counter lags the client's answer by a loop turn).
    serve.wait_until(lambda: job_ended_early(serve) == ended_before + 1, "P counts the cut job", timeout_s=30)
    serve.wait_restarted("decode-0", incarnation)
    assert shm_files(old_pid) == []  # the supervisor removed the dead worker's pool and fence
    serve.wait_idle()
    response = complete(serve.url, prompt, 6)
    assert response.json()["choices"][0]["text"] == expected
    serve.wait_idle()


@pytest.mark.parametrize("worker", ["prefill-0", "decode-0"])
def test_sigstop_then_sigcont_mid_request(cluster, reference, worker):
    serve, _ = cluster
    prompt = prompt_of(400, seed=23 if worker == "prefill-0" else 24)  # no prefix hit on the second
    expected = expected_text(reference, prompt, 8)
    computed_before = serve.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, serve.url, prompt, 8)
        serve.wait_until(lambda: started_prefill(serve, computed_before), "P prefilling")
        serve.signal(worker, signal.SIGSTOP)
        time.sleep(1.0)  # frozen for half the lease: long enough to stall the other side, short of expiry
        serve.signal(worker, signal.SIGCONT)
        exact_or_clear_error(future.result(timeout=90), expected)
    serve.wait_idle()
    assert serve.metric("prefill-0", "pdserve:kv_blocks_in_use") == 0
    assert serve.metric("decode-0", "pdserve:kv_blocks_held_for_peer") == 0
