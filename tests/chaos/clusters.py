"""The two clusters faults are injected into, behind one small interface (members, workers(), metric(),
fault(), heal(), close()):

- ``ServeCluster``: ``pdserve serve --prefill 2 --decode 2`` as a user runs it (every member on
  loopback, KV over shm, the supervisor restarting whatever dies). SIGKILL and SIGSTOP/SIGCONT.
- ``NetnsCluster``: the same 2 + 2 workers and gateway, each in its own network namespace on a bridge,
  KV over zmq/TCP, started per role (``pdserve <role>``) as containers would be. Link-down: the host's
  veth goes down and comes back up; its process lives on, cut off. Processes here are not supervised,
  so only link faults are injected. Without namespaces it cannot run, and says why.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common.client import parse_metric
from cluster.keygen import write_private_key
from tests.cluster_harness import ServeProcess
from tests.netns import ROOT, Host, Network

PREFILL, DECODE = ["prefill-0", "prefill-1"], ["decode-0", "decode-1"]
WORKERS = PREFILL + DECODE
MEMBERS = ["gateway"] + WORKERS
BLOCK = 16
LEASE_S = 2.0  # a reservation a dead or cut-off peer stops renewing is freed after this
WORKER_TIMEOUT_S = 2.0  # the gateway drops a worker silent this long
MAX_NUM_SEQS = 2  # sequences a worker runs at once: a prefill worker's further jobs wait
SETTINGS = {  # section -> field -> value, the same in both clusters
    # small chunks and batches: a prompt takes many steps, so each phase lasts long enough to strike in
    "engine": {"block_size": BLOCK, "prefill_chunk_size": 8, "kv_cache_memory_mb": 8, "max_num_seqs": MAX_NUM_SEQS},
    "gateway": {
        "local_prefill_max_tokens": 0,
        "worker_heartbeat_s": 0.2,
        "worker_timeout_s": WORKER_TIMEOUT_S,
        "request_timeout_s": 30.0,
        "routing_policy": "round_robin",
    },
    "transfer": {"lease_seconds": LEASE_S},
}


def read_metric(url: str, name: str) -> float:
    return parse_metric(urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode(), name)


def registered_workers(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/v1/workers", timeout=5) as response:
        return json.loads(response.read())["data"]


class ServeCluster:
    faults = ("sigkill", "sigstop")

    def __init__(self, model: str, tmp: Path, **more: dict):
        """``more``: section -> fields on top of SETTINGS (the hostile scenarios' key file, HTTP limits)."""
        self.model = model
        sections = {name: {**SETTINGS.get(name, {}), **more.get(name, {})} for name in {*SETTINGS, *more}}
        self.serve = ServeProcess(Path(model), tmp, num_prefill=2, num_decode=2, **sections)
        self.url = self.serve.url
        self.log = self.serve.log
        self._stopped: int | None = None  # the pid frozen by the last SIGSTOP

    def workers(self) -> list[dict]:
        return self.serve.workers()

    def metric(self, member: str, name: str) -> float:
        return read_metric(self.url, name) if member == "gateway" else self.serve.metric(member, name)

    def pid(self, member: str) -> int:
        if member != "gateway":
            return self.serve.worker_pid[member]
        supervisor = self.serve.proc.pid
        for child in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split():
            if "\0gateway" in Path(f"/proc/{child}/cmdline").read_text():  # python -m gateway ...
                return int(child)
        raise LookupError("the supervisor has no gateway child")

    def fault(self, fault: str, member: str) -> None:
        pid = self.pid(member)
        os.kill(pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        self._stopped = pid if fault == "sigstop" else None

    def heal(self, fault: str, member: str) -> None:
        if fault == "sigstop":  # (a killed member is the supervisor's to restart)
            os.kill(self._stopped, signal.SIGCONT)

    def logs(self) -> str:
        return "".join([line for line in self.log if " HTTP/1.1" not in line][-30:])

    def close(self, keep_logs: bool = False) -> None:
        """``keep_logs``: write the cluster's whole log to a new file, for a failure's post-mortem."""
        if self._stopped:  # never leave a frozen member behind an interrupted scenario
            os.kill(self._stopped, signal.SIGCONT)
        stopped = self.serve.stop()
        if keep_logs:
            fd, path = tempfile.mkstemp(prefix="chaos-serve-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write("".join(self.log))
            print(f"chaos: pdserve serve cluster log in {path}")
        assert stopped == 0, "".join(self.log[-30:])


class NoNamespaces(RuntimeError):
    """Network namespaces cannot be made here: link-down scenarios are reported as not run."""


class NetnsCluster:
    faults = ("linkdown",)

    def __init__(self, model: str):
        self.model = model
        self.net = Network()
        if not self.net.isolated:
            self.net.close()
            raise NoNamespaces(f"no network namespaces: {self.net.reason}")
        self.hosts: dict[str, Host] = {}
        self.log: list[str] = []
        common = {f"{section}.{key}": value for section, fields in SETTINGS.items() for key, value in fields.items()}
        common.update(
            {
                "model.path": model,
                "engine.num_threads": 1,
                "gateway.port": 8000,
                "gateway.worker_port": 8001,
                "transfer.cluster_key_file": write_private_key(),
            }
        )  # CURVE between the hosts, as deployed
        try:
            for index, member in zip((10, 11, 12, 21, 22), MEMBERS):
                role = member.split("-")[0]
                sets = common if role == "gateway" else {**common, f"{role}.worker_id": member}
                self.hosts[member] = Host(self.net, member, index, role, sets, str(ROOT / "configs" / "multinode.yaml"))
            self.url = f"http://{self.hosts['gateway'].address}:8000"
            give_up = time.monotonic() + 120
            while any(h.http_port is None for name, h in self.hosts.items() if name != "gateway"):
                if time.monotonic() > give_up:  # every worker prints READY with its metrics port
                    raise RuntimeError(f"workers did not start:\n{self.logs()}")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def workers(self) -> list[dict]:
        return registered_workers(self.url)

    def metric(self, member: str, name: str) -> float:
        return read_metric(self.url, name) if member == "gateway" else self.hosts[member].metric(name)

    def fault(self, fault: str, member: str) -> None:
        self.net.set_link(member, up=False)

    def heal(self, fault: str, member: str) -> None:
        self.net.set_link(member, up=True)

    def logs(self) -> str:
        return "".join(f"--- {n}\n" + "".join(h.log[-10:]) for n, h in self.hosts.items())

    def close(self, keep_logs: bool = False) -> None:
        """``keep_logs``: write every member's whole log to a new directory, for a failure's post-mortem."""
        for host in self.hosts.values():
            host.stop()
        self.net.close()
        if keep_logs:
            logs = Path(tempfile.mkdtemp(prefix="chaos-netns-logs-"))
            for name, host in self.hosts.items():
                (logs / f"{name}.log").write_text("".join(host.log))
            print(f"chaos: link-down cluster logs in {logs}")
