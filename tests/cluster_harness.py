"""Starts ``pdserve serve`` as a user would (a real gateway, prefill and decode processes on loopback)
and reads what the test needs from it: the URL, each worker's metrics port, the registered workers."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

READY_LINE = re.compile(r"READY http_port=(\d+) .*worker_id=(\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model_dir: Path, tmp: Path, num_prefill: int = 1, num_decode: int = 1, **sections):
        self.port = free_port()
        config = dict(sections)
        config["gateway"] = {**{"worker_port": free_port(), "worker_heartbeat_s": 0.2}, **sections.get("gateway", {})}
        self.config_path = tmp / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "cluster", "serve", "--model", str(model_dir), "--port", str(self.port),
                "--prefill", str(num_prefill), "--decode", str(num_decode), "--config", str(self.config_path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self.worker_http: dict[str, int] = {}  # worker_id -> metrics port (latest incarnation)
        threading.Thread(target=self._read, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_for("pdserve: ready", timeout_s=240)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if match := READY_LINE.search(line):
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

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/v1/workers", timeout=5) as response:
            return json.loads(response.read())["data"]

    def wait_idle(self, timeout_s: float = 30.0) -> list[dict]:
        """Registered workers once every one reports no KV block in use and nothing running."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            workers = self.workers()
            if workers and all(w["load"]["kv_blocks_in_use"] == 0 and w["load"]["num_running"] == 0
                               and w["load"]["num_waiting"] == 0 for w in workers):
                return workers
            time.sleep(0.2)
        raise AssertionError(f"workers not idle: {self.workers()}")

    def metric(self, worker_id: str, name: str) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.worker_http[worker_id]}/metrics", timeout=5).read()
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)
