"""pdserve across hosts: the gateway, 2 prefill and 2 decode workers each in its own network namespace
(one veth each, joined by a bridge), started as a container would start them
(``pdserve <role> --config configs/multinode.yaml``: interface eth0, the gateway by name). KV blocks
cross namespaces over the zmq transport; greedy output equals the single engine's. A third decode worker
joins at run time and takes traffic; one is stopped with SIGTERM mid-stream: it drains and no request
fails. Without root (or where `ip netns add` fails) the same scenario runs on loopback, and says so."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from cluster.keygen import write_private_key
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.model_factory import tiny_model_dir
from tests.netns import ROOT, Host, Network, poll_until

PRESET = str(ROOT / "configs" / "multinode.yaml")
LONG_TOKENS = 1000  # the drain's requests: ~1 s of streaming on the tiny model, where the metric poll sees it


def wait_until(predicate, what: str, timeout_s: float = 60.0, hosts: dict | None = None):
    if value := poll_until(predicate, timeout_s, poll_s=0.05):
        return value
    tails = "".join(f"--- {n}\n" + "".join(h.log[-8:]) for n, h in (hosts or {}).items())
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pools_across_namespaces_scale_and_drain():
    model = str(tiny_model_dir("llama"))
    reference = LLM(model, block_size=16)
    net = Network()
    hosts: dict[str, Host] = {}
    gw_port, worker_port = (8000, 8001) if net.isolated else (free_port(), free_port())
    common = {
        "model.path": model,
        "engine.block_size": 16,
        "engine.num_kv_blocks": 96,
        "engine.num_threads": 1,
        "engine.prefill_chunk_size": 24,
        "gateway.worker_heartbeat_s": 0.2,
        "gateway.worker_port": worker_port,
        "transfer.cluster_key_file": write_private_key(),
    }  # CURVE across the namespaces, as deployed
    if not net.isolated:  # one host: every worker on loopback, each on free ports
        common.update(
            {
                "gateway.host": "127.0.0.1",
                "prefill.host": "127.0.0.1",
                "decode.host": "127.0.0.1",
                "prefill.port": 0,
                "prefill.http_port": 0,
                "decode.port": 0,
                "decode.kv_port": 0,
                "decode.http_port": 0,
                "prefill.gateway_address": f"tcp://127.0.0.1:{worker_port}",
                "decode.gateway_address": f"tcp://127.0.0.1:{worker_port}",
            }
        )

    def start(name: str, index: int, role: str) -> Host:
        # round robin: a worker that joins idle is chosen on the next turn (prefix/least-loaded routing
        # would let ties on idle workers go to the lowest id); every prompt goes through a prefill worker
        extra = (
            {"gateway.port": gw_port, "gateway.local_prefill_max_tokens": 0, "gateway.routing_policy": "round_robin"}
            if role == "gateway"
            else {f"{role}.worker_id": name, f"{role}.drain_timeout_s": 30}
        )
        hosts[name] = Host(net, name, index, role, {**common, **extra}, PRESET)
        return hosts[name]

    def workers() -> dict[str, dict]:
        with urllib.request.urlopen(f"{url}/v1/workers", timeout=5) as response:
            return {w["id"]: w for w in json.loads(response.read())["data"]}

    def complete(prompt: list[int], max_tokens: int) -> tuple[int, str]:
        body = json.dumps(
            {"model": model, "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        ).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())["choices"][0]["text"]
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def expected(prompt: list[int], max_tokens: int) -> str:
        [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return reference.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)

    try:
        gateway = start("gw", 10, "gateway")
        url = f"http://{gateway.address}:{gw_port}"
        for name, index, role in (
            ("p0", 11, "prefill"),
            ("p1", 12, "prefill"),
            ("d0", 21, "decode"),
            ("d1", 22, "decode"),
        ):
            start(name, index, role)
        wait_until(lambda: {"p0", "p1", "d0", "d1"} <= workers().keys(), "4 workers registered", 90, hosts)
        listed = workers()
        for name in ("p0", "p1", "d0", "d1"):  # each advertises its own host's address, not a name or 0.0.0.0
            assert listed[name]["address"].startswith(f"tcp://{hosts[name].address}:"), listed[name]

        # KV crosses hosts over zmq: every prompt is prefilled on P and decoded on D
        prompts = [prompt_of(40 + 9 * i, seed=i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: complete(p, 8), prompts))
        assert results == [(200, expected(p, 8)) for p in prompts]
        assert sum(hosts[d].metric("pdserve:kv_transfer_bytes_count", transport="zmq") for d in ("d0", "d1")) >= 6
        assert sum(hosts[p].metric("pdserve:prefill_jobs_total") for p in ("p0", "p1")) >= 6

        # scale out: a third decode worker joins at run time, registers and takes traffic
        start("d2", 23, "decode")
        wait_until(lambda: "d2" in workers(), "d2 registered", 60, hosts)
        fresh = [prompt_of(33 + 5 * i, seed=100 + i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: complete(p, 8), fresh))
        assert results == [(200, expected(p, 8)) for p in fresh]
        assert hosts["d2"].metric("pdserve:generation_tokens_total") > 0
        assert hosts["d2"].metric("pdserve:kv_transfer_bytes_count", transport="zmq") > 0

        # scale in: SIGTERM a decode worker while it streams; it drains, exits 0, and no request fails
        # (48 tokens each, as before, took 40 ms on an idle host: done before the poll below saw them)
        long = [prompt_of(30 + 3 * i, seed=200 + i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, p, LONG_TOKENS) for p in long]
            wait_until(lambda: hosts["d0"].metric("vllm:num_requests_running") > 0, "d0 running a request", 60, hosts)
            hosts["d0"].proc.send_signal(signal.SIGTERM)
            results = [f.result() for f in futures]
        assert results == [(200, expected(p, LONG_TOKENS)) for p in long]
        assert hosts["d0"].proc.wait(timeout=45) == 0, "".join(hosts["d0"].log[-20:])
        wait_until(lambda: "d0" not in workers(), "d0 gone from the registry", 30, hosts)
        assert complete(prompts[0], 8) == (200, expected(prompts[0], 8))  # the rest keep serving
    finally:
        for host in hosts.values():
            if host.proc.poll() is None:
                host.proc.send_signal(signal.SIGTERM)
        for host in hosts.values():
            try:
                host.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait()
        net.close()
    assert (
        not [
            ns
            for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(net.prefix)
        ]
        if net.isolated
        else True
    )
