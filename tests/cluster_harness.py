"""Starts ``pdserve serve`` as a user would (a real gateway, prefill and decode processes on loopback)
and reads what the test needs from it: the URL, each worker's metrics port, the registered workers."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from benchmarks.common.launcher import free_ports, serve_argv

READY_LINE = re.compile(r"READY http_port=(\d+) .*worker_id=(\S+)")
READY_PID = re.compile(r"READY .* pid=(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(
        self,
        model_dir: Path,
        tmp: Path,
        num_prefill: int = 1,
        num_decode: int = 1,
        num_gateways: int = 1,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        **sections,
    ):
        """``extra_args``: more `pdserve serve` flags; ``env``: variables over this process's."""
        self.port = free_ports(num_gateways)
        config = dict(sections)
        config["gateway"] = {
            **{"worker_port": free_ports(num_gateways), "worker_heartbeat_s": 0.2},
            **sections.get("gateway", {}),
        }
        self.config = config
        self.config_path = tmp / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        argv = [*serve_argv(model_dir, self.port, num_prefill, num_decode, num_gateways, self.config_path), *extra_args]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self.worker_http: dict[str, int] = {}  # worker_id -> metrics port (latest incarnation)
        self.worker_pid: dict[str, int] = {}  # worker_id -> OS pid (latest incarnation)
        threading.Thread(target=self._read, daemon=True).start()
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(num_gateways)]
        self.url = self.urls[0]
        try:
            self._wait_for("pdserve: ready", timeout_s=240)
            # /ready needs only one decode worker: wait for every member to register and announce itself.
            expected = {f"prefill-{i}" for i in range(num_prefill)} | {f"decode-{i}" for i in range(num_decode)}
            for url in self.urls:
                self.wait_until(
                    lambda: {w["id"] for w in self.workers(url)} == expected and expected <= set(self.worker_http),
                    f"every worker registered at {url}",
                    timeout_s=120,
                    poll_s=0.1,
                )
        except BaseException:
            self.stop()  # never leave a half-started cluster behind for later tests to trip over
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if match := READY_LINE.search(line):
                if pid := READY_PID.search(line):
                    self.worker_pid[match.group(2)] = int(pid.group(1))
                self.worker_http[match.group(2)] = int(match.group(1))
            self.lines.put(line)

    def _wait_for(self, text: str, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            try:
                if text in self.lines.get(timeout=1):
                    return
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        raise TimeoutError(f"'{text}' not printed; log tail:\n{''.join(self.log[-30:])}")

    def workers(self, url: str | None = None) -> list[dict]:
        """The workers registered with the gateway at ``url`` (the first one by default)."""
        keys = self.config["gateway"].get("api_keys") or []
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        request = urllib.request.Request(f"{url or self.url}/v1/workers", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())["data"]

    def wait_idle(self, timeout_s: float = 30.0) -> list[dict]:
        """Registered workers once every one reports no KV block in use and nothing running, and each
        has run its idle block-integrity check since then with no violation ever."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            workers = self.workers()
            if workers and all(
                w["load"]["kv_blocks_in_use"] == 0 and w["load"]["num_running"] == 0 and w["load"]["num_waiting"] == 0
                for w in workers
            ):
                self._assert_integrity_checked([w["id"] for w in workers], give_up)
                return workers
            time.sleep(0.2)
        raise AssertionError(f"workers not idle: {self.workers()}")

    def _assert_integrity_checked(self, worker_ids: list[str], give_up: float) -> None:
        for worker_id in worker_ids:
            if worker_id not in self.worker_http:
                continue  # started outside this harness
            checks = self.metric(worker_id, "pdserve:kv_integrity_checks_total")
            while checks < 1 and time.monotonic() < give_up:
                time.sleep(0.2)
                checks = self.metric(worker_id, "pdserve:kv_integrity_checks_total")
            assert checks >= 1, f"{worker_id} never ran its idle integrity check"
            assert self.metric(worker_id, "pdserve:kv_integrity_violations_total") == 0, (
                f"{worker_id}: integrity violated"
            )

    def metric(self, worker_id: str, name: str) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.worker_http[worker_id]}/metrics", timeout=5).read()
        family = re.sub(r"_(count|sum|bucket)$", "", name.split("{")[0])  # a histogram's series -> its family
        total, exported = 0.0, False
        for line in body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
            exported = exported or family in line  # a labelled family with no such sample yet: its HELP line
        if not exported:  # a misspelt or renamed series must fail the test, not read as 0
            raise KeyError(f"{worker_id} exports no {name}")
        return total

    def registered(self, worker_id: str) -> dict | None:
        """The gateway's /v1/workers entry of the worker; None while it is not registered."""
        return next((w for w in self.workers() if w["id"] == worker_id), None)

    def load(self, worker_id: str) -> dict | None:
        """The worker's last heartbeat load as the gateway sees it; None while it is not registered."""
        entry = self.registered(worker_id)
        return entry["load"] if entry else None

    def wait_until(self, predicate, what: str, timeout_s: float = 30.0, poll_s: float = 0.05):
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if value := predicate():
                return value
            time.sleep(poll_s)
        raise AssertionError(
            f"timed out after {timeout_s:.0f} s waiting for {what}; log tail:\n"
            + "".join([line for line in self.log if " HTTP/1.1" not in line][-40:])
        )

    def signal(self, worker_id: str, sig: int) -> int:
        """Send ``sig`` to the worker's current process; returns its pid."""
        pid = self.worker_pid[worker_id]
        os.kill(pid, sig)
        return pid

    def wait_restarted(self, worker_id: str, old_incarnation: str, timeout_s: float = 60.0) -> int:
        """The supervisor restarted the worker and the new process registered with the gateway (a new
        incarnation); returns the new pid."""
        self.wait_until(
            lambda: (w := self.registered(worker_id)) and w["incarnation"] != old_incarnation,
            f"{worker_id} registered again",
            timeout_s,
            poll_s=0.2,
        )
        return self.worker_pid[worker_id]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


class RawStream:
    """A streaming completion on a bare socket, so a test can hang up at any moment (the gateway sees
    the client disconnect and aborts the request on every worker that holds it)."""

    def __init__(self, url: str, body: dict):
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        self.received = b""

    def read_until(self, text: bytes, count: int = 1, timeout_s: float = 60.0) -> bytes:
        self.sock.settimeout(timeout_s)
        while self.received.count(text) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received

    def hang_up(self) -> None:
        self.sock.close()
