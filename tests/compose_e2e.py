"""deploy/compose.yaml on a real Docker engine, end to end (run by scripts/compose-test):

1. build the image (only the gateway service builds it), start 2 prefill + 2 decode + the gateway on
   a fresh cache volume with a new key set (`pdserve keygen --out`, a secret per role, each file 0400 and
   owned by the containers' uid 10001 as docs/deploy.md says), and time until a completion is served (cold);
2. serve requests: greedy output equals this machine's engine on the same embedded model;
3. under a request loop, `up -d --scale decode=1` then `--scale decode=2`: no request fails, and the
   gateway and the prefill pool keep their containers (same id, same start, no restart);
4. under the loop, restart one decode container in place (`docker restart`): no request fails;
5. `down` keeping the volumes, `up` again and time until served (warm: kernel builds and matmul
   forms come from the cache volume);
6. `down -v` (the image stays, so the next run builds from cache).

Requests go to the published port on 127.0.0.1 only. Every wait is bounded; the containers are
removed even when a step fails."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster.keygen import main as keygen

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ["docker", "compose", "-f", str(ROOT / "deploy" / "compose.yaml"), "-p", "pdserve-e2e"]
MODEL = "pdserve-small"  # the embedded model's served name


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] compose-test: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_dir() -> str:
    """A new key set as the operator makes one (docs/deploy.md): `pdserve keygen --out keys`, each file
    0400 and owned by uid 10001. Compose bind-mounts a file secret as it is on the host (it ignores
    uid/gid/mode for file secrets), and a key file open to group or others stops the worker: so this needs
    root (the chown), as the Docker engine does."""
    folder = tempfile.mkdtemp(prefix="pdserve-keys-")
    if keygen(["--out", folder]) != 0:
        raise RuntimeError("pdserve keygen failed")
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o400)
        os.chown(os.path.join(folder, name), 10001, 10001)
    os.chown(folder, 10001, 10001)
    return folder


@dataclass
class Deployment:
    port: int = field(default_factory=free_port)
    api_key: str = field(default_factory=lambda: secrets.token_hex(16))
    keys: str = field(default_factory=lambda: keys_dir())

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PDSERVE_PORT": str(self.port),
            "PDSERVE_API_KEY": self.api_key,
            "PDSERVE_KEYS_DIR": self.keys,
            "PDSERVE_PREFILL_REPLICAS": "2",
            "PDSERVE_DECODE_REPLICAS": "2",
        }

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        done = subprocess.run(
            [*COMPOSE, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def containers(self, service: str) -> dict[str, tuple[str, int]]:
        """container id -> (start time, restart count) of the service's running containers."""
        ids = self.compose("ps", "-q", service).split()
        out = {}
        for cid in ids:
            started, restarts = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.StartedAt}} {{.RestartCount}}", cid],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            out[cid] = (started, int(restarts))
        return out

    def request(self, path: str, body: dict | None = None, timeout_s: float = 120) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"authorization": f"Bearer {self.api_key}", "content-type": "application/json"}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data, headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")[:500]

    def complete(self, prompt: list[int]) -> tuple[int, object]:
        status, body = self.request(
            "/v1/completions",
            {"model": MODEL, "prompt": [prompt], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        )
        return status, body["choices"][0]["text"] if status == 200 else body

    def workers(self) -> dict[str, dict]:
        status, body = self.request("/v1/workers", timeout_s=5)
        return {w["id"]: w for w in body["data"]} if status == 200 else {}

    def pool(self, role: str) -> dict[str, dict]:
        return {wid: w for wid, w in self.workers().items() if w["role"] == role and not w["draining"]}


def wait_for(predicate, what: str, timeout_s: float):
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            if value := predicate():
                return value
        except OSError:  # not listening yet, or a connection reset while it starts
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class RequestLoop:
    """Completions from ``clients`` threads, each one request after another, until stopped; every answer
    checked against the reference text. Two clients keep both decode workers busy (one idle client
    would see every tie go to the same worker). Counts what failed and keeps the failures to report."""

    def __init__(self, deployment: Deployment, cases: list[tuple[list[int], str]], clients: int = 2):
        self.deployment, self.cases = deployment, cases
        self.served = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, clients), daemon=True) for i in range(clients)]

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _run(self, first: int, stride: int) -> None:
        i = first
        while not self._stop.is_set():
            prompt, want = self.cases[i % len(self.cases)]
            try:
                got = self.deployment.complete(prompt)
            except OSError as exc:
                got = (0, repr(exc))
            with self._lock:
                if got == (200, want):
                    self.served += 1
                else:
                    self.failures.append(f"{got[0]}: {str(got[1])[:300]}")
            i += stride

    def wait_served(self, count: int, timeout_s: float = 300) -> None:
        start = self.served
        wait_for(lambda: self.served >= start + count, f"{count} more requests served", timeout_s)


def reference_cases(count: int) -> list[tuple[list[int], str]]:
    """Prompts and the greedy text this machine's engine gives on the embedded model (the image makes
    the same checkpoint: cluster/default_model.py, seed 0)."""
    import torch

    from cluster.default_model import default_model_dir
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    with tempfile.TemporaryDirectory() as cache:
        llm = LLM(str(default_model_dir(cache)), block_size=16)
        cases = []
        prompts = [
            torch.randint(5, 768, (24 + seed % 40,), generator=torch.Generator().manual_seed(seed)).tolist()
            for seed in range(count)
        ]  # distinct prompts: no prefix hit steers them to one worker
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for prompt, out in zip(prompts, outs, strict=True):
            cases.append((prompt, llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)))
    return cases


def time_to_ready(d: Deployment, cases, timeout_s: float) -> float:
    """Seconds from `up -d` until 2 prefill + 2 decode are registered and a completion is served."""
    start = time.monotonic()
    d.compose("up", "-d")
    wait_for(
        lambda: len(d.pool("prefill")) == 2 and len(d.pool("decode")) == 2, "2 prefill + 2 decode registered", timeout_s
    )
    wait_for(lambda: d.complete(cases[0][0]) == (200, cases[0][1]), "a completion served", 120)
    return time.monotonic() - start


def scale_decode(d: Deployment, loop: RequestLoop, figures: dict) -> None:
    gateway, prefill = d.containers("gateway"), d.containers("prefill")
    for replicas in (1, 2):
        log(f"scaling decode to {replicas} under the request loop")
        d.compose("up", "-d", "--scale", f"decode={replicas}")  # the operator's command, as documented
        wait_for(
            lambda n=replicas: len(d.pool("decode")) == n and len(d.containers("decode")) == n,
            f"{replicas} decode workers",
            300,
        )
        loop.wait_served(10)
    assert d.containers("gateway") == gateway, "the gateway container was recreated or restarted"
    assert d.containers("prefill") == prefill, "the prefill pool was recreated or restarted"
    figures["scale_failures"] = len(loop.failures)


def restart_decode(d: Deployment, loop: RequestLoop, figures: dict) -> None:
    before = {w["incarnation"] for w in d.pool("decode").values()}
    victim = min(d.containers("decode"))
    log(f"restarting decode container {victim[:12]} in place under the request loop")
    subprocess.run(["docker", "restart", "-t", "40", victim], check=True, capture_output=True, timeout=120)
    restarted_at = time.time()

    # back with a new incarnation (same worker id: same hostname and pid), or a new id
    def back() -> bool:
        now = d.pool("decode")
        return len(now) == 2 and {w["incarnation"] for w in now.values()} != before

    wait_for(back, "the restarted decode worker registered again", 300)
    loop.wait_served(30)

    def served_by_restarted() -> int:  # requests the restarted worker finished since it came back
        logs = subprocess.run(
            ["docker", "logs", "--since", str(int(restarted_at)), victim], capture_output=True, text=True, check=True
        )
        return (logs.stdout + logs.stderr).count(" finished: ")

    figures["served_by_restarted"] = wait_for(served_by_restarted, "the restarted worker serving requests", 300)
    figures["restart_failures"] = len(loop.failures) - figures["scale_failures"]


def main() -> int:
    began = time.monotonic()
    d = Deployment()
    figures: dict[str, object] = {}
    log("computing reference outputs on this machine")
    cases = reference_cases(60)
    try:
        log("building the image (cached layers are reused)")
        start = time.monotonic()
        d.compose("build", timeout_s=1800)
        figures["build_s"] = round(time.monotonic() - start, 1)
        size = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Size}}", "pdserve:local"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        figures["image_bytes"] = int(size)
        d.compose("down", "-v", "--remove-orphans")  # a fresh cache volume: the cold start
        log("starting 2 prefill + 2 decode + gateway (cold cache volume)")
        figures["ready_cold_s"] = round(time_to_ready(d, cases, 900), 1)
        published = d.compose("port", "gateway", "8000").strip()
        assert published == f"127.0.0.1:{d.port}", published  # loopback unless the operator opts in
        anonymous = urllib.request.Request(f"http://127.0.0.1:{d.port}/v1/models")
        try:
            urllib.request.urlopen(anonymous, timeout=5)
            raise AssertionError("the API answered without the key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401, exc.code
        results = [d.complete(p) for p, _ in cases[:6]]
        assert results == [(200, want) for _, want in cases[:6]], results
        start = time.monotonic()
        with RequestLoop(d, cases) as loop:
            scale_decode(d, loop, figures)
            figures["scale_s"] = round(time.monotonic() - start, 1)
            restart_decode(d, loop, figures)
        figures["scale_and_restart_s"] = round(time.monotonic() - start, 1)
        figures["requests_in_loop"] = loop.served + len(loop.failures)
        figures["failures"] = loop.failures[:10]
        log("down (volumes kept), then up again: the warm start")
        d.compose("down")
        figures["ready_warm_s"] = round(time_to_ready(d, cases, 900), 1)
    finally:
        try:
            log("tearing down (down -v)")
            d.compose("down", "-v", "--remove-orphans")
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # report; do not hide the step that failed
            log(f"teardown failed: {exc}")
        shutil.rmtree(d.keys, ignore_errors=True)
        figures["total_s"] = round(time.monotonic() - began, 1)
        print(json.dumps(figures, indent=2), flush=True)
    failed = figures.get("scale_failures", 0) + figures.get("restart_failures", 0)
    log("PASS" if not failed else f"FAIL: {failed} requests failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
