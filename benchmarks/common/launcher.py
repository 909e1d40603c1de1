"""Starts one system under test with ``pdserve serve`` (as a user would), pinned to the benchmark's
cores, and reads back what the benchmark needs: the gateway URL, the served model id, each worker's
metrics URL and the process tree.

The serve process and everything it starts run with the same CPU affinity (inherited from the
pre-exec hook), so every system competes for the same cores; ``pdserve serve`` splits its cores'
threads between its workers (``engine.num_threads``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
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
SERVE_LINE = re.compile(r"\((\d+) prefill \+ (\d+) decode workers, (\d+) thread\(s\) each(?:; decode (\d+) while)?")
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (``pdserve serve --gateways N`` takes port, +1, ...)."""
    while True:
        first = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first + 1, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
                return first
            except OSError:
                continue


def _pinned(cpus: set[int]):
    def hook() -> None:  # in the child, before exec: same cores as every other system; die with us
        os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass

    return hook


def serve_argv(
    model_dir: Path, port: int, num_prefill: int, num_decode: int, num_gateways: int, config_path: Path
) -> list[str]:
    """The `pdserve serve` command line of a local cluster on ``port`` (and the ports after it)."""
    return [
        sys.executable,
        "-m",
        "cluster",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--prefill",
        str(num_prefill),
        "--decode",
        str(num_decode),
        "--gateways",
        str(num_gateways),
        "--config",
        str(config_path),
    ]


class ServedSystem:
    """``pdserve serve --prefill N --decode M --gateways G`` with ``sections`` written as its YAML config."""

    def __init__(
        self,
        name: str,
        model_dir: Path,
        workdir: Path,
        cpus: set[int],
        num_prefill: int,
        num_decode: int,
        sections: dict,
        ready_timeout_s: float = 300.0,
        num_gateways: int = 1,
    ):
        self.name = name
        self.port = free_ports(num_gateways)
        config = {
            **sections,
            "gateway": {
                "worker_port": free_ports(num_gateways),
                "worker_heartbeat_s": 0.5,
                **sections.get("gateway", {}),
            },
        }
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        argv = serve_argv(model_dir, self.port, num_prefill, num_decode, num_gateways, config_path)
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_pinned(cpus)
        )
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(num_gateways)]
        self.url = self.urls[0]
        self.worker_http: dict[str, int] = {}  # worker_id -> metrics port
        self.threads_per_worker = 0
        self.decode_idle_threads = 0  # the decode worker's threads while no prompt is out (1P+1D), else 0
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_for("pdserve: ready", ready_timeout_s)
        self.model = self._get("/v1/models")["data"][0]["id"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if match := READY_LINE.search(line):
                self.worker_http[match.group(2)] = int(match.group(1))
            if match := SERVE_LINE.search(line):
                self.threads_per_worker = int(match.group(3))
                self.decode_idle_threads = int(match.group(4) or 0)
            self._lines.put(line)

    @property
    def threads(self) -> str:
        """The serve line's threads, for the benchmark's tables."""
        borrowed = f", decode {self.decode_idle_threads} while no prompt is out" if self.decode_idle_threads else ""
        return f"{self.threads_per_worker} thread(s) per worker{borrowed}"

    def _wait_for(self, text: str, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            try:
                if text in self._lines.get(timeout=1):
                    return
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"{self.name}: '{text}' not printed; see {self.log_path}")

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return json.loads(response.read())

    def metrics_urls(self, role: str) -> list[str]:
        return [
            f"http://127.0.0.1:{port}/metrics" for wid, port in sorted(self.worker_http.items()) if wid.startswith(role)
        ]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until every worker reports nothing running, waiting or holding KV (between runs)."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            workers = self._get("/v1/workers")["data"]
            if workers and all(
                w["load"]["kv_blocks_in_use"] == 0 and w["load"]["num_running"] == 0 and w["load"]["num_waiting"] == 0
                for w in workers
            ):
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name}: workers not idle after {timeout_s} s")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
