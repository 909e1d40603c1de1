"""Bounds and per-request fields on a served cluster (a real gateway, prefill and decode processes):
token-id prompts with added special tokens above the tokenizer's base vocabulary, cache_salt keeping
prefix caches apart on both workers, and a client that never reads its stream dropped with its
request aborted and every KV block freed."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.cluster_harness import ServeProcess
from tests.model_factory import ADDED_IN_GAP_ID, ADDED_PAST_EMBEDDING_ID, added_tokens_model_dir

BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        added_tokens_model_dir(),
        tmp_path_factory.mktemp("bounds"),
        engine={"block_size": BLOCK, "kv_cache_memory_mb": 16},
        gateway={"local_prefill_max_tokens": 0, "http_write_timeout_s": 1.0},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def post(cluster, path: str, **body) -> httpx.Response:
    return httpx.post(cluster.url + path, json={"model": str(added_tokens_model_dir()), **body}, timeout=120)


def test_token_ids_with_an_added_special_token_are_served(cluster):
    prompt = [10, 11, ADDED_IN_GAP_ID, 12, 13]
    r = post(cluster, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 4)
    r = post(cluster, "/v1/completions", prompt=[10, ADDED_PAST_EMBEDDING_ID], max_tokens=4)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"token id {ADDED_PAST_EMBEDDING_ID} is out of range [0, 768): the "
        "tokenizer's highest id is 800; the model's embedding has 768 rows"
    )
    cluster.wait_idle()


def cached(cluster, salt: str | None, prompt: list[int]) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    r = post(cluster, "/v1/completions", prompt=prompt, max_tokens=2, temperature=0.0, **extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_keeps_prefix_caches_apart(cluster):
    prompt = [(7 * i) % 600 + 5 for i in range(4 * BLOCK + 3)]
    assert cached(cluster, "tenant-a", prompt) == 0
    cluster.wait_idle()
    assert cached(cluster, "tenant-b", prompt) == 0  # the same prompt, another tenant: nothing shared
    assert cached(cluster, None, prompt) == 0
    cluster.wait_idle()
    assert cached(cluster, "tenant-a", prompt) == 4 * BLOCK  # its own tenant: every full block
    assert cached(cluster, "tenant-b", prompt) == 4 * BLOCK
    cluster.wait_idle()


def gateway_metric(cluster, name: str) -> float:
    for line in httpx.get(cluster.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_never_reads_is_dropped_and_its_blocks_freed(cluster):
    aborted_before = gateway_metric(cluster, 'pdserve:requests_total{outcome="aborted"}')
    body = json.dumps(
        {
            "model": str(added_tokens_model_dir()),
            "prompt": [5] * 20,
            "max_tokens": 1500,
            "n": 8,
            "logprobs": 20,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    host, port = cluster.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the gateway backs up
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        cluster.wait_until(
            lambda: gateway_metric(cluster, 'pdserve:requests_total{outcome="aborted"}') > aborted_before,
            "the stalled stream's request aborted",
            timeout_s=300,
            poll_s=0.5,
        )
    finally:
        sock.close()
    assert any("client read nothing for 1 s" in line for line in cluster.log)  # dropped by the write timeout
    cluster.wait_idle(timeout_s=120)  # every block back, on both workers, integrity checked
    assert post(cluster, "/v1/completions", prompt=[10, 11, 12], max_tokens=2).status_code == 200
