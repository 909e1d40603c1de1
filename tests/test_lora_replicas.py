"""LoRA behind two gateways (``pdserve serve --gateways 2``): the workers hold the cluster's one adapter
list, so an adapter loaded through either gateway is served and listed by both, a gateway or worker
that starts later catches up, unloading through either drops it everywhere, and loads made through
both gateways at once both stand."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.cluster_harness import ServeProcess
from tests.lora_factory import peft_greedy, tiny_adapter_dir
from tests.model_factory import tiny_model_dir
from tests.test_gateway_replicas import gateway_pid

FAMILY = "llama"
NEW_TOKENS = 6
PROMPT = torch.randint(5, 700, (19,), generator=torch.Generator().manual_seed(5)).tolist()


ADMIN_KEY = "admin-test-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir(FAMILY),
        tmp_path_factory.mktemp("lora-replicas"),
        num_gateways=2,
        engine={"block_size": 16, "kv_cache_memory_mb": 8},
        gateway={"admin_api_keys": [ADMIN_KEY]},  # runtime adapter changes need an admin key
        lora={"enable_lora": True, "lora_modules": [f"alpha={tiny_adapter_dir('alpha', FAMILY)}"], "max_lora_rank": 8},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(FAMILY))
    return {n: tokenizer.decode(peft_greedy(FAMILY, n, [PROMPT], NEW_TOKENS)[0]) for n in ("alpha", "beta")}


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
    )


def models(url: str) -> set[str]:
    try:
        return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    except httpx.HTTPError:  # a gateway being restarted
        return set()


def change(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}_lora_adapter", headers=ADMIN, json=body, timeout=120)


def test_an_adapter_loaded_through_one_gateway_is_served_and_listed_by_both(cluster, expected):
    a, b = cluster.urls
    assert change(a, "load", lora_name="gamma", lora_path=str(tiny_adapter_dir("beta", FAMILY))).status_code == 200
    cluster.wait_until(lambda: "gamma" in models(b), "b to list gamma", timeout_s=30)
    for url in (a, b):
        answer = complete(url, "gamma")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected["beta"]  # gamma holds beta's weights
        assert all("gamma" in w["lora_names"] for w in cluster.workers(url)), cluster.workers(url)
    again = change(b, "load", lora_name="gamma", lora_path="/elsewhere")
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]


def test_a_gateway_and_a_worker_that_start_later_serve_it_too(cluster, expected):
    a, b = cluster.urls
    os.kill(gateway_pid(cluster, cluster.port + 1), signal.SIGKILL)  # the supervisor starts b afresh
    cluster.wait_until(
        lambda: "gamma" in models(b) and len(cluster.workers(b)) == 2, "the new b to learn gamma", timeout_s=120
    )
    assert complete(b, "gamma").json()["choices"][0]["text"] == expected["beta"]
    old = cluster.registered("decode-0")["incarnation"]
    cluster.signal("decode-0", signal.SIGKILL)  # restarts from its config, which names alpha only
    cluster.wait_restarted("decode-0", old, timeout_s=120)
    cluster.wait_until(
        lambda: "gamma" in (cluster.registered("decode-0") or {}).get("lora_names", []),
        "the new decode worker to load gamma",
        timeout_s=60,
    )
    for url in (a, b):
        assert complete(url, "gamma").json()["choices"][0]["text"] == expected["beta"]


def test_loads_through_both_gateways_at_once_both_stand(cluster, expected):
    a, b = cluster.urls
    path = str(tiny_adapter_dir("alpha", FAMILY))
    with ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(lambda job: change(job[0], "load", lora_name=job[1], lora_path=path), [(a, "x"), (b, "y")])
        )
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    for url in (a, b):
        cluster.wait_until(lambda url=url: {"x", "y"} <= models(url), f"{url} to list x and y", timeout_s=30)
        assert complete(url, "y").json()["choices"][0]["text"] == expected["alpha"]


def test_unloading_through_either_gateway_drops_it_everywhere(cluster, expected):
    a, b = cluster.urls
    for name in ("gamma", "x", "y", "alpha"):  # alpha: the config's own, unloaded at run time
        assert change(b, "unload", lora_name=name).status_code == 200
    for url in (a, b):
        cluster.wait_until(lambda url=url: not {"gamma", "x", "y", "alpha"} & models(url), f"{url} to drop them")
        assert complete(url, "gamma").status_code == 404 and complete(url, "alpha").status_code == 404
        assert all(w["lora_names"] == [] for w in cluster.workers(url)), cluster.workers(url)
    gone = change(a, "unload", lora_name="gamma")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'gamma' cannot be found."
    assert change(a, "load", lora_name="alpha", lora_path=str(tiny_adapter_dir("alpha", FAMILY))).status_code == 200
    cluster.wait_until(lambda: "alpha" in models(b), "b to list alpha again", timeout_s=30)
    assert complete(b, "alpha").json()["choices"][0]["text"] == expected["alpha"]
