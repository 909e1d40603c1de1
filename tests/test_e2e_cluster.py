"""The product end to end: ``pdserve serve`` (gateway + prefill + decode processes on loopback) and the
official openai client. Greedy output through prefill -> KV transfer -> decode equals the single
engine's, for every prompt shape the KV hand-off can get wrong; the cluster ends idle and exits clean."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
CHUNK = 24  # several prefill chunks per prompt, not aligned with blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_model_dir("llama")
    serve = ServeProcess(
        model,
        tmp_path_factory.mktemp("cluster"),
        engine={"block_size": BLOCK, "prefill_chunk_size": CHUNK, "kv_cache_memory_mb": 8},
        gateway={"local_prefill_max_tokens": 0},  # every uncached prompt goes through the prefill worker
    )
    yield serve
    pids = list(serve.worker_pid.values())
    assert serve.stop() == 0, "".join(serve.log[-30:])
    assert pids and not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a worker outlived pdserve serve"


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_model_dir("llama")), block_size=BLOCK)
    return llm


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_text(reference: LLM, prompt: list[int], max_tokens: int) -> str:
    [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return reference.tokenizer.decode(out.outputs[0].token_ids)


def complete(client, prompt: list[int], max_tokens: int = 12, **extra):
    return client.completions.create(
        model=str(tiny_model_dir("llama")),
        prompt=[prompt],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, **extra},
    )


@pytest.mark.parametrize("length", [5, BLOCK, 4 * BLOCK, 3 * CHUNK + 7])
def test_disaggregated_greedy_equals_single_engine(cluster, client, reference, length):
    prompt = prompt_of(length, seed=length)
    computed_before = cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total")
    response = complete(client, prompt)
    assert response.choices[0].text == expected_text(reference, prompt, 12)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == length and response.usage.completion_tokens == 12
    # The prompt really went through the prefill worker (nothing was cached anywhere yet).
    assert cluster.metric("prefill-0", "pdserve:prefill_computed_tokens_total") - computed_before == length
    cluster.wait_idle()


def test_full_and_partial_prefix_hits_on_the_decode_worker(cluster, client, reference):
    prompt = prompt_of(5 * BLOCK + 3, seed=99)
    first = complete(client, prompt)
    again = complete(client, prompt)  # full hit: every full block is cached on the decode worker
    assert again.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    extended = prompt + prompt_of(2 * BLOCK, seed=100)
    partial = complete(client, extended)  # partial hit: the shared blocks stay, the rest is new
    assert partial.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    assert first.choices[0].text == again.choices[0].text == expected_text(reference, prompt, 12)
    assert partial.choices[0].text == expected_text(reference, extended, 12)
    cluster.wait_idle()


def test_n_completions_equal_the_engine_and_share_one_transfer(cluster, client, reference):
    prompt = prompt_of(3 * BLOCK + 1, seed=7)
    bytes_before = cluster.metric("decode-0", "pdserve:kv_transfer_bytes_sum")
    response = client.completions.create(
        model=str(tiny_model_dir("llama")),
        prompt=[prompt],
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    [expected] = reference.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    )
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [reference.tokenizer.decode(c.token_ids) for c in expected.outputs]
    # All but the last prompt token crossed once: 48 tokens = 3 blocks, not 3 x 3.
    moved = cluster.metric("decode-0", "pdserve:kv_transfer_bytes_sum") - bytes_before
    assert moved == 3 * reference.engine.runner.kv_pool.layout.bytes_per_block
    cluster.wait_idle()


def test_client_disconnect_mid_stream_frees_everything(cluster, client):
    failures_before = cluster.metric("decode-0", "pdserve:request_failure_total")
    stream = client.completions.create(
        model=str(tiny_model_dir("llama")),
        prompt=[prompt_of(40, seed=5)],
        max_tokens=2000,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    # The tiny model writes 2000 tokens in about a second: freeze the decode worker so the hang-up
    # surely lands mid-generation, then let it see the abort.
    cluster.signal("decode-0", signal.SIGSTOP)
    try:
        assert first.choices[0].finish_reason is None
        stream.close()
        time.sleep(0.5)  # the gateway notices the disconnect and sends AbortRequest
    finally:
        cluster.signal("decode-0", signal.SIGCONT)
    cluster.wait_until(
        lambda: cluster.metric("decode-0", "pdserve:request_failure_total") > failures_before,
        "the decode worker counts the aborted request",
    )
    workers = cluster.wait_idle()
    assert {w["id"] for w in workers} == {"prefill-0", "decode-0"}


def test_errors_reach_the_client_as_openai_errors(cluster, client):
    with pytest.raises(openai.BadRequestError, match="2048"):
        complete(client, prompt_of(2100, seed=1))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
