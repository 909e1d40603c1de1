"""LoRA behind two gateways (``pdserve serve --gateways 2``): an adapter loaded at run time through one
gateway serves there while the other's list (the config's) leaves it loaded on the workers — the two
lists never undo each other — and the other gateway, which never heard of it, answers 404."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.cluster_harness import ServeProcess
from tests.lora_factory import tiny_adapter_dir
from tests.model_factory import tiny_model_dir

FAMILY = "llama"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir(FAMILY),
        tmp_path_factory.mktemp("lora-replicas"),
        num_gateways=2,
        engine={"block_size": 16, "kv_cache_memory_mb": 8},
        lora={"enable_lora": True, "lora_modules": [f"alpha={tiny_adapter_dir('alpha', FAMILY)}"], "max_lora_rank": 8},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0.0},
    )


def test_an_adapter_loaded_through_one_gateway_stays_loaded_and_the_other_404s_it(cluster):
    a, b = cluster.urls
    body = {"lora_name": "gamma", "lora_path": str(tiny_adapter_dir("beta", FAMILY))}
    assert httpx.post(f"{a}/v1/load_lora_adapter", json=body, timeout=120).status_code == 200
    time.sleep(2.0)  # ten heartbeats to both gateways: b's own list (alpha only) must not drop gamma
    for url in (a, b):
        assert all("gamma" in w["lora_names"] for w in cluster.workers(url)), cluster.workers(url)
    assert complete(a, "gamma").status_code == 200
    assert complete(b, "gamma").status_code == 404  # b never loaded it
    assert complete(b, "alpha").status_code == 200 and complete(a, "alpha").status_code == 200
