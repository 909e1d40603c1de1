"""A decode worker that comes back in place — the same worker id and the same KV address, a new process
(a container restarted by Docker or Kubernetes) — serves its next requests with none failing.

The prefill worker's KV sender was handshaken with the old process; the gateway's registry saw the old
incarnation. Real processes, each role started as the deployments start it (``python -m <role>``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from cluster.keygen import write_private_key
from cluster.local_cluster import remove_shm_segments
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import free_port
from tests.model_factory import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


class Roles:
    """gateway, prefill-0 and decode-0 as separate processes with fixed addresses."""

    def __init__(self, tmp: Path, transport: str):
        self.port, self.kv_port, worker_port = free_port(), free_port(), free_port()
        gateway_address = f"tcp://127.0.0.1:{worker_port}"
        config = {
            "model": {"path": str(tiny_model_dir("llama"))},
            "engine": {"block_size": BLOCK, "kv_cache_memory_mb": 8, "num_threads": 1},
            "gateway": {
                "port": self.port,
                "worker_port": worker_port,
                "worker_heartbeat_s": 0.2,
                "worker_timeout_s": 30.0,
                "local_prefill_max_tokens": 0,
            },
            "prefill": {"port": 0, "http_port": 0, "worker_id": "prefill-0", "gateway_address": gateway_address},
            "decode": {
                "port": 0,
                "http_port": 0,
                "kv_port": self.kv_port,
                "worker_id": "decode-0",
                "gateway_address": gateway_address,
            },
            "transfer": {"transport": transport, "cluster_key_file": write_private_key(str(tmp))},  # CURVE, as deployed
        }
        self.config_path = tmp / "roles.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = tmp
        self.procs = {name: self.start(name) for name in ("gateway", "prefill", "decode")}

    def start(self, role: str) -> subprocess.Popen:
        module = {"gateway": "gateway", "prefill": "prefill_node", "decode": "decode_node"}[role]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        log = open(self.logs / f"{role}.log", "a")
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(self.config_path)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def workers(self) -> dict[str, dict]:
        try:
            return {w["id"]: w for w in httpx.get(f"{self.url}/v1/workers", timeout=5).json()["data"]}
        except httpx.HTTPError:
            return {}

    def wait_until(self, predicate, what: str, timeout_s: float = 180.0):
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if value := predicate():
                return value
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log_tail(name)}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def log_tail(self, role: str) -> str:
        return "".join((self.logs / f"{role}.log").read_text().splitlines(keepends=True)[-30:])

    def metric(self, name: str, role: str = "gateway") -> float:
        """A counter of the gateway, or of a worker (its /metrics port from its READY line)."""
        url = self.url
        if role != "gateway":
            ready = [line for line in (self.logs / f"{role}.log").read_text().splitlines() if line.startswith("READY")]
            url = f"http://127.0.0.1:{ready[-1].split('http_port=')[1].split()[0]}"
        body = httpx.get(f"{url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            remove_shm_segments(proc.pid)


@pytest.fixture(params=["shm", "zmq"])  # one host (what auto picks here), across hosts (compose, Kubernetes)
def roles(tmp_path, request):
    roles = Roles(tmp_path, request.param)
    try:
        roles.wait_until(lambda: set(roles.workers()) == {"prefill-0", "decode-0"}, "both workers registered")
        yield roles
    finally:
        roles.stop()


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(5, 768, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_decode_worker_restarted_in_place_serves_every_next_request(roles):
    reference = LLM(str(tiny_model_dir("llama")), block_size=BLOCK)
    prompts = [prompt_of(2 * BLOCK + 5 + i, seed=i) for i in range(6)]
    expected = []
    for prompt in prompts:
        [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        expected.append(reference.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True))

    def complete(prompt: list[int]) -> httpx.Response:
        return httpx.post(
            f"{roles.url}/v1/completions",
            timeout=120,
            json={
                "model": str(tiny_model_dir("llama")),
                "prompt": [prompt],
                "max_tokens": 8,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )

    first = complete(prompts[0])  # the prefill worker's sender is handshaken with this decode process
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected[0], first.text

    old = roles.workers()["decode-0"]["incarnation"]
    roles.procs["decode"].kill()
    roles.procs["decode"].wait()
    remove_shm_segments(roles.procs["decode"].pid)
    roles.procs["decode"] = roles.start("decode")  # same id, same KV address, a new incarnation
    roles.wait_until(
        lambda: roles.workers().get("decode-0", {}).get("incarnation", old) != old, "decode-0 registered again"
    )

    for prompt, text in zip(prompts, expected):
        response = complete(prompt)
        assert response.status_code == 200, (response.text, roles.log_tail("prefill"), roles.log_tail("decode"))
        assert response.json()["choices"][0]["text"] == text
    # The prefill worker noticed the restart before its first transfer (its connection to the old process
    # closed, or the job named a newer incarnation) and handshook again with the new process, once;
    # nothing failed on the way, so the gateway had nothing to retry.
    assert roles.metric('pdserve:kv_handshakes_total{result="accepted"}', "decode") == 1
    assert roles.metric('pdserve:route_decisions_total{policy="prefix",result="retry"}') == 0
    assert roles.metric("pdserve:prefill_jobs_rejected_total", "prefill") == 0
