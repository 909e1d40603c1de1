"""LoRA through ``pdserve serve`` (P/D split, prefix cache on): the base and two adapters requested
concurrently give PEFT's greedy tokens; no KV is shared across adapters; adapters load and unload at
run time on every worker; bad adapters are refused by name and the server keeps serving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.cluster_harness import RawStream, ServeProcess, free_port
from tests.lora_factory import peft_greedy, tiny_adapter_dir
from tests.model_factory import tiny_model_dir
from tests.test_lora_engine import broken_copy, wrong_shape

FAMILY = "llama"
BLOCK = 16
NEW_TOKENS = 10
ADMIN_KEY = "admin-test-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    modules = [f"{n}={tiny_adapter_dir(n, FAMILY)}" for n in ("alpha", "beta")]
    serve = ServeProcess(
        tiny_model_dir(FAMILY),
        tmp_path_factory.mktemp("lora-cluster"),
        engine={"block_size": BLOCK, "prefill_chunk_size": 24, "kv_cache_memory_mb": 8},
        # every uncached prompt goes through the prefill worker; runtime LoRA changes need the admin key
        gateway={"local_prefill_max_tokens": 0, "admin_api_keys": [ADMIN_KEY]},
        # one device slot for two (then three) adapters: every mixed batch pages them in and out
        lora={"enable_lora": True, "lora_modules": modules, "max_loras": 1, "max_cpu_loras": 2, "max_lora_rank": 8},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 700, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def text_of(tokens: list[int]) -> str:
    return AutoTokenizer.from_pretrained(tiny_model_dir(FAMILY)).decode(tokens, skip_special_tokens=True)  # as served


def complete(client, model: str, prompt: list[int]):
    return client.completions.create(
        model=model, prompt=[prompt], max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )


def unload(cluster, name: str) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": name}, timeout=120)


def base_name() -> str:
    return str(tiny_model_dir(FAMILY))


def test_models_lists_each_adapter_with_the_base_as_parent(client) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base_name(), "alpha", "beta"}
    assert cards["alpha"].parent == base_name() and cards["beta"].parent == base_name()
    assert cards["alpha"].root == str(tiny_adapter_dir("alpha", FAMILY))


def test_base_and_two_adapters_concurrently_equal_peft(client) -> None:
    prompts = [prompt_of(n, seed) for seed, n in enumerate([7, 40, 23])]
    models = {"": base_name(), "alpha": "alpha", "beta": "beta"}
    expected = {n: peft_greedy(FAMILY, n, prompts, NEW_TOKENS) for n in models}
    jobs = [(n, i) for i in range(len(prompts)) for n in models]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: they share the workers' batches
        answers = list(pool.map(lambda job: complete(client, models[job[0]], prompts[job[1]]), jobs))
    for (name, i), answer in zip(jobs, answers):
        assert answer.model == models[name]
        assert answer.choices[0].text == text_of(expected[name][i]), f"adapter {name!r} prompt {i}"


def test_prefix_cache_is_never_shared_across_adapters(client) -> None:
    prompt = prompt_of(3 * BLOCK + 5, seed=99)
    first = complete(client, "alpha", prompt)
    again = complete(client, "alpha", prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # its own KV is reused
    assert again.choices[0].text == first.choices[0].text
    for other in ("beta", base_name()):  # the same prompt, another adapter / the base: nothing cached
        assert complete(client, other, prompt).usage.prompt_tokens_details.cached_tokens == 0, other


def test_unknown_model_is_a_404_naming_it(cluster) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["message"].startswith("The model `gamma` does not exist")


def test_load_and_unload_at_run_time(cluster, client) -> None:
    prompt = prompt_of(30, seed=7)
    body = {"lora_name": "gamma", "lora_path": str(tiny_adapter_dir("alpha", FAMILY))}
    for headers in ({}, {"Authorization": "Bearer not-the-admin"}):  # an ordinary caller changes nothing
        refused = httpx.post(f"{cluster.url}/v1/load_lora_adapter", headers=headers, json=body, timeout=120)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert "needs an admin API key" in refused.json()["error"]["message"]
        gone = httpx.post(f"{cluster.url}/v1/unload_lora_adapter", headers=headers, json={"lora_name": "alpha"})
        assert gone.status_code == 403
    assert {"alpha", "beta"} <= {m.id for m in client.models.list().data} and "gamma" not in {
        m.id for m in client.models.list().data
    }
    r = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter",
        headers=ADMIN,
        timeout=120,
        json={"lora_name": "gamma", "lora_path": str(tiny_adapter_dir("alpha", FAMILY))},
    )
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' added successfully."
    assert "gamma" in {m.id for m in client.models.list().data}
    assert all("gamma" in w["lora_names"] for w in cluster.workers()), cluster.workers()  # both pools
    expected = text_of(peft_greedy(FAMILY, "alpha", [prompt], NEW_TOKENS)[0])  # gamma holds alpha's weights
    assert complete(client, "gamma", prompt).choices[0].text == expected
    again = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "gamma", "lora_path": "/x"}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    r = httpx.post(f"{cluster.url}/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "gamma"}, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert "gamma" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "gamma", prompt)
    gone = httpx.post(f"{cluster.url}/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "gamma"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'gamma' cannot be found."

    # gamma again, now from beta's directory: none of the old gamma's KV is reused, beta's tokens come out
    r = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter",
        headers=ADMIN,
        timeout=120,
        json={"lora_name": "gamma", "lora_path": str(tiny_adapter_dir("beta", FAMILY))},
    )
    assert r.status_code == 200, r.text
    reloaded = complete(client, "gamma", prompt)
    assert reloaded.usage.prompt_tokens_details.cached_tokens == 0
    assert reloaded.choices[0].text == text_of(peft_greedy(FAMILY, "beta", [prompt], NEW_TOKENS)[0])
    assert unload(cluster, "gamma").status_code == 200


def test_load_and_unload_under_traffic_leave_other_requests_exact(cluster, client) -> None:
    prompts = [prompt_of(12 + i, seed=40 + i) for i in range(6)]
    expected = {n: peft_greedy(FAMILY, n, prompts, NEW_TOKENS) for n in ("", "alpha")}
    jobs = [(n, i) for i in range(len(prompts)) for n in ("", "alpha")]
    models = {"": base_name(), "alpha": "alpha"}
    with ThreadPoolExecutor(4) as pool:
        answers = pool.map(lambda job: complete(client, models[job[0]], prompts[job[1]]), jobs)
        for _ in range(2):  # the adapter list changes on every worker while those run
            body = {"lora_name": "epsilon", "lora_path": str(tiny_adapter_dir("beta", FAMILY))}
            assert (
                httpx.post(f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=120).status_code
                == 200
            )
            assert (
                httpx.post(
                    f"{cluster.url}/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "epsilon"}, timeout=120
                ).status_code
                == 200
            )
        for (name, i), answer in zip(jobs, list(answers)):
            assert answer.choices[0].text == text_of(expected[name][i]), (name, i)


def test_a_worker_that_joins_later_gets_the_adapters_loaded_at_run_time(cluster, client) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter",
        headers=ADMIN,
        timeout=120,
        json={"lora_name": "delta", "lora_path": str(tiny_adapter_dir("beta", FAMILY))},
    )
    assert r.status_code == 200, r.text
    for worker_id in ("decode-0", "prefill-0"):  # killed: the supervisor starts a new process from the config
        # its current process (a READY line names it; the pid read earlier may be a restarted one's)
        cluster.wait_until(
            lambda worker_id=worker_id: os.path.exists(f"/proc/{cluster.worker_pid[worker_id]}"),
            f"{worker_id}'s process",
            timeout_s=60,
            poll_s=0.1,
        )
        old = cluster.registered(worker_id)["incarnation"]
        cluster.signal(worker_id, signal.SIGKILL)
        cluster.wait_restarted(worker_id, old, timeout_s=120)
        cluster.wait_until(
            lambda worker_id=worker_id: "delta" in cluster.registered(worker_id)["lora_names"],
            f"{worker_id} loaded delta after its restart",
            timeout_s=60,
            poll_s=0.1,
        )
    prompt = prompt_of(21, seed=11)
    expected = text_of(peft_greedy(FAMILY, "beta", [prompt], NEW_TOKENS)[0])
    assert complete(client, "delta", prompt).choices[0].text == expected
    assert unload(cluster, "delta").status_code == 200


@pytest.mark.parametrize("path,message", [
    ("/nonexistent/adapter", "LoRA adapter 'bad': no adapter_config.json in /nonexistent/adapter"),
    ("rank16", "LoRA adapter 'bad' has rank 16, above max_lora_rank=8"),
    ("wrong_shape", "v_proj has lora_A [4, 64] and lora_B [33, 4]; this base model expects"),
])  # fmt: skip
def test_bad_adapter_at_run_time_is_a_400_and_the_server_keeps_serving(cluster, client, path, message) -> None:
    if path == "rank16":
        path = broken_copy("alpha", rank_16)
    elif path == "wrong_shape":
        path = broken_copy("alpha", wrong_shape)
    r = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "bad", "lora_path": path}, timeout=120
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert "bad" not in {m.id for m in client.models.list().data}
    assert complete(client, "alpha", prompt_of(9, seed=5)).choices[0].text  # still serving, adapters intact


def rank_16(config, tensors):
    config["r"] = 16
    for key in list(tensors):
        a_or_b = tensors[key]
        tensors[key] = torch.zeros(16, a_or_b.shape[1]) if "lora_A" in key else torch.zeros(a_or_b.shape[0], 16)


def test_bad_adapter_at_start_up_stops_serve_with_the_adapter_named(tmp_path) -> None:
    bad = broken_copy("alpha", wrong_shape)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"gateway": {"worker_port": free_port()}, "engine": {"kv_cache_memory_mb": 8}}))
    argv = [
        sys.executable,
        "-m",
        "cluster",
        "serve",
        "--model",
        str(tiny_model_dir(FAMILY)),
        "--port",
        str(free_port()),
        "--config",
        str(config),
        "--enable-lora",
        "--lora-modules",
        f"bad={bad}",
        "--max-lora-rank",
        "8",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 78, done.stdout + done.stderr  # EX_CONFIG: no restart can help
    assert "LoRA adapter 'bad': layer 0 v_proj has lora_A [4, 64] and lora_B [33, 4]" in done.stdout + done.stderr


def test_unloading_an_adapter_its_running_requests_use_lets_them_finish_exactly(cluster) -> None:
    body = {"lora_name": "theta", "lora_path": str(tiny_adapter_dir("alpha", FAMILY))}
    assert httpx.post(f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=120).status_code == 200
    prompt, length = prompt_of(20, seed=70), 160
    stream = RawStream(
        cluster.url, {"model": "theta", "prompt": prompt, "max_tokens": length, "temperature": 0.0, "ignore_eos": True}
    )
    stream.read_until(b"data: ", count=2)  # decoding under theta
    assert unload(cluster, "theta").status_code == 200
    received = stream.read_until(b"data: [DONE]", timeout_s=120).decode()
    stream.hang_up()
    chunks = [json.loads(line[6:]) for line in received.split("\n") if line.startswith("data: {")]
    assert "error" not in chunks[-1], chunks[-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == text_of(peft_greedy(FAMILY, "alpha", [prompt], length)[0])


def test_an_adapter_directory_rewritten_and_loaded_again_serves_the_new_weights_uncached(cluster, client, tmp_path):
    path = tmp_path / "zeta"
    shutil.copytree(tiny_adapter_dir("alpha", FAMILY), path)
    prompt = prompt_of(40, seed=71)  # two full blocks of 16: cached under the first zeta
    body = {"lora_name": "zeta", "lora_path": str(path)}
    assert httpx.post(f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=120).status_code == 200
    expected = {n: text_of(peft_greedy(FAMILY, n, [prompt], NEW_TOKENS)[0]) for n in ("alpha", "beta")}
    assert complete(client, "zeta", prompt).choices[0].text == expected["alpha"]
    assert complete(client, "zeta", prompt).usage.prompt_tokens_details.cached_tokens == 32
    assert unload(cluster, "zeta").status_code == 200
    for file in ("adapter_config.json", "adapter_model.safetensors"):  # in place: same directory, same names
        (path / file).write_bytes((tiny_adapter_dir("beta", FAMILY) / file).read_bytes())
    assert httpx.post(f"{cluster.url}/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=120).status_code == 200
    again = complete(client, "zeta", prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # none of the old weights' KV
    assert again.choices[0].text == expected["beta"]
    assert unload(cluster, "zeta").status_code == 200
