"""Two gateways in front of one worker pool (``pdserve serve --gateways 2``), real processes: every
worker registers with both; both serve, token for token as one engine; a Responses conversation goes on
across them through their shared Redis store, background cancels included; a gateway killed outright
leaves the other serving, and the workers abort the dead one's requests and free their blocks; it comes
back (the supervisor restarts it) and is used again. Two gateways routing to one decode worker never
oversubscribe its KV: the worker itself admits, and says Busy when it cannot."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import urllib.request

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import RawStream, ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
MODEL = str(tiny_model_dir("llama"))
GATEWAY_TIMEOUT_S = 3.0  # workers take a gateway silent this long for dead


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("replicas"),
        num_gateways=2,
        model={"max_model_len": 2048},
        engine={"block_size": BLOCK, "num_kv_blocks": 160, "prefill_chunk_size": 32},
        gateway={"local_prefill_max_tokens": 0, "worker_timeout_s": GATEWAY_TIMEOUT_S},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, block_size=BLOCK)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_ids(reference: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return list(out.outputs[0].token_ids)


def complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    """Greedy; the answer names its tokens by id (logprobs), so it compares with the engine's exactly."""
    return httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "model": MODEL,
            "prompt": [prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )


def ids_of(answer: httpx.Response) -> list[int]:
    assert answer.status_code == 200, answer.text
    return [int(token.removeprefix("token_id:")) for token in answer.json()["choices"][0]["logprobs"]["tokens"]]


def gateway_pid(serve: ServeProcess, port: int) -> int:
    """The pid of the supervisor's gateway child that serves HTTP on ``port``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if parent == serve.proc.pid and b"gateway" in argv and str(port).encode() in argv:
            return int(entry)
    raise AssertionError(f"no gateway process on port {port}")


def test_every_worker_registers_with_both_gateways_and_both_serve_as_one_engine(cluster, reference):
    for url in cluster.urls:
        assert {w["id"] for w in cluster.workers(url)} == {"prefill-0", "decode-0"}
    prompts = [prompt_of(20 + 9 * i, seed=i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: complete(cluster.urls[i % 2], prompts[i], 12), range(6)))
    for prompt, answer in zip(prompts, answers):
        assert ids_of(answer) == expected_ids(reference, prompt, 12)
    cluster.wait_idle()


def test_a_responses_conversation_goes_on_across_replicas(cluster, reference):
    a, b = cluster.urls
    hf_tok = AutoTokenizer.from_pretrained(MODEL)
    ask = {"model": MODEL, "max_output_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first = httpx.post(f"{a}/v1/responses", timeout=60, json={**ask, "input": "Tell me about foxes."}).json()
    after = httpx.post(
        f"{b}/v1/responses", timeout=60, json={**ask, "input": "And wolves?", "previous_response_id": first["id"]}
    ).json()
    # B's prompt is the whole conversation, which only A answered: it came from the shared store
    messages = [
        {"role": "user", "content": "Tell me about foxes."},
        {"role": "assistant", "content": first["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "And wolves?"},
    ]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert after["usage"]["input_tokens"] == len(ids)
    whole = httpx.post(f"{a}/v1/responses", timeout=60, json={**ask, "input": messages, "store": False}).json()
    assert after["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert httpx.get(f"{b}/v1/responses/{first['id']}", timeout=10).json() == first
    assert httpx.get(f"{a}/v1/responses/{after['id']}", timeout=10).json() == after
    items = httpx.get(f"{a}/v1/responses/{after['id']}/input_items", timeout=10).json()
    assert [item["content"][0]["text"] for item in items["data"]] == ["And wolves?"]
    assert httpx.delete(f"{b}/v1/responses/{first['id']}", timeout=10).json()["deleted"] is True
    gone = httpx.get(f"{a}/v1/responses/{first['id']}", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_a_background_response_is_cancelled_from_the_other_replica(cluster):
    a, b = cluster.urls
    queued = httpx.post(
        f"{a}/v1/responses",
        timeout=60,
        json={"model": MODEL, "input": "Count.", "background": True, "max_output_tokens": 1500, "ignore_eos": True},
    ).json()
    assert queued["status"] == "queued"
    cluster.wait_until(
        lambda: httpx.get(f"{b}/v1/responses/{queued['id']}", timeout=10).json()["status"] == "in_progress",
        "the response running, as B reads it",
        timeout_s=60,
    )
    cancelled = httpx.post(f"{b}/v1/responses/{queued['id']}/cancel", timeout=60).json()
    assert cancelled["status"] == "cancelled"
    assert httpx.get(f"{a}/v1/responses/{queued['id']}", timeout=10).json()["status"] == "cancelled"
    cluster.wait_idle()  # A aborted it on the workers


def test_a_killed_gateway_leaves_the_other_serving_and_its_requests_freed(cluster, reference):
    a, b = cluster.urls
    stream = RawStream(
        b,
        {"model": MODEL, "prompt": prompt_of(40, seed=50), "max_tokens": 1900, "temperature": 0.0, "ignore_eos": True},
    )
    stream.read_until(b"data: ", count=3)  # decoding on the workers, for B
    background = httpx.post(
        f"{b}/v1/responses",
        timeout=60,
        json={"model": MODEL, "input": "Count.", "background": True, "max_output_tokens": 1500, "ignore_eos": True},
    ).json()
    cluster.wait_until(
        lambda: httpx.get(f"{a}/v1/responses/{background['id']}", timeout=10).json()["status"] == "in_progress",
        "B's background response running",
        timeout_s=60,
    )
    os.kill(gateway_pid(cluster, cluster.port + 1), signal.SIGKILL)
    # A serves on, every worker still registered with it
    prompt = prompt_of(30, seed=51)
    assert ids_of(complete(a, prompt, 8)) == expected_ids(reference, prompt, 8)
    assert {w["id"] for w in cluster.workers(a)} == {"prefill-0", "decode-0"}
    # the workers take B for dead and free what its requests held (they would run for ~1900 and ~1500
    # tokens otherwise)
    cluster.wait_until(
        lambda: any("lost: aborting its 2 requests" in line for line in cluster.log),
        "the decode worker to abort the dead gateway's requests",
        timeout_s=60,
    )
    cluster.wait_idle(timeout_s=60)
    stream.hang_up()
    # the background response died with B: A reads it failed once B's liveness key has expired
    failed = cluster.wait_until(
        lambda: (r := httpx.get(f"{a}/v1/responses/{background['id']}", timeout=10).json())["status"] == "failed" and r,
        "the dead replica's response failed",
        timeout_s=60,
    )
    assert "stopped before it ended" in failed["error"]["message"]
    # B comes back (the supervisor restarts it): the workers register with it again and it serves
    cluster.wait_until(
        lambda: _registered(cluster, b) == {"prefill-0", "decode-0"},
        "B back with every worker",
        timeout_s=120,
        poll_s=0.3,
    )
    assert ids_of(complete(b, prompt, 8)) == expected_ids(reference, prompt, 8)
    cluster.wait_idle()


def busy_answers(serve: ServeProcess) -> float:
    """How many requests the decode worker answered Busy (its own metric)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{serve.worker_http['decode-0']}/metrics", timeout=5).read()
    lines = [
        line for line in body.decode().splitlines() if line.startswith('pdserve:request_failure_total{reason="busy"}')
    ]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0  # the series appears with the first Busy


def routed_locally(url: str) -> float:
    """Requests a gateway routed to a decode worker that prefills them itself (its own metric)."""
    body = httpx.get(f"{url}/metrics", timeout=5).text
    prefix = "pdserve:route_decisions_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(prefix) and 'result="local"' in line
    )


def _registered(cluster: ServeProcess, url: str) -> set[str]:
    try:
        return {w["id"] for w in cluster.workers(url)}
    except OSError:
        return set()


# --- two gateways, one decode worker with room for one request at a time ---------------------------

POOL_BLOCKS = 12  # a 100-token prompt takes 7 blocks plus one to decode into: two never fit together


@pytest.fixture
def small_pool(tmp_path):
    # Heartbeats a minute apart: both gateways keep the view of an empty worker that registration gave
    # them, so the second request is routed there and the worker alone turns it away.
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path,
        num_prefill=0,
        num_gateways=2,
        engine={"block_size": BLOCK, "num_kv_blocks": POOL_BLOCKS, "prefill_chunk_size": 32},
        gateway={"worker_heartbeat_s": 60.0, "worker_timeout_s": 180.0, "max_queued_requests": 0},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def test_two_gateways_never_oversubscribe_one_decode_worker(small_pool, reference):
    # The worker is stopped while both gateways route a request to it, each from its view of an empty
    # worker; resumed, it reads both before it could finish either, admits one and says Busy to the other.
    # Which one wins is the worker's socket's choice, so the test takes either; no timing decides it.
    prompts = {url: prompt_of(100, seed=60 + i) for i, url in enumerate(small_pool.urls)}
    routed = {url: routed_locally(url) for url in small_pool.urls}
    small_pool.signal("decode-0", signal.SIGSTOP)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        answers = {url: pool.submit(complete, url, prompt, 40) for url, prompt in prompts.items()}
        for url in small_pool.urls:
            small_pool.wait_until(lambda: routed_locally(url) > routed[url], f"gateway {url} routed its request")
    finally:
        small_pool.signal("decode-0", signal.SIGCONT)
        pool.shutdown(wait=False)
    served = {url: answer.result() for url, answer in answers.items()}
    refused = [answer for answer in served.values() if answer.status_code != 200]
    for url, answer in served.items():
        if answer.status_code == 200:
            assert ids_of(answer) == expected_ids(reference, prompts[url], 40)
    if refused:
        assert len(refused) == 1 and refused[0].status_code == 503, [answer.text for answer in served.values()]
        assert "busy" in refused[0].json()["error"]["message"], refused[0].text
        assert busy_answers(small_pool) == 1
    else:
        # A busy host can deliver the second request to the worker only after the first has finished
        # (both were sent while it was stopped, but its I/O thread decrypts them one by one). Then the
        # second fits and admitting it is right: the worker's log must show the two never overlapped.
        assert busy_answers(small_pool) == 0

        def worker_events() -> list[tuple[str, str]]:
            return [
                (kind, answer.json()["id"])
                for line in list(small_pool.log)
                if "decode_node.server" in line  # the worker's lines (the gateway logs a "finished:" too)
                for answer in served.values()
                for kind in ("local prefill", "finished")
                if f"rid={answer.json()['id']}" in line and f" {kind}:" in line
            ]

        # The log is read on a thread: the last line may come in after the answer.
        small_pool.wait_until(lambda: len(worker_events()) >= 4, "the worker's log of both requests")
        events = worker_events()
        first, second = events[0][1], [rid for _, rid in events if rid != events[0][1]][0]
        assert events == [("local prefill", first), ("finished", first), ("local prefill", second),
                          ("finished", second)], events  # fmt: skip
    # many at once from both gateways: each one the worker admitted is served exactly, the rest are 503
    prompts = [prompt_of(100, seed=70 + i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: complete(small_pool.urls[i % 2], prompts[i], 4), range(6)))
    for prompt, answer in zip(prompts, answers):
        if answer.status_code == 200:
            assert ids_of(answer) == expected_ids(reference, prompt, 4)
        else:
            assert answer.status_code == 503 and answer.json()["error"]["message"], answer.text
    small_pool.wait_idle()  # no block left held, and the worker's integrity check found nothing wrong
