"""A whole pdserve cluster on one machine: one gateway or several plus N prefill and M decode workers,
each its own OS process (``python -m <role>``), supervised.

- Workers bind port 0 (any free port) and find each other through the gateways they register with, so
  only each gateway's two ports are fixed. Several gateways (``gateway-0``, ``gateway-1``, ...) serve
  the same pools; every worker registers with each, and a ``redis-server`` holds their shared
  Responses store when no other one is named.
- A member that exits on its own is restarted (with a short backoff); the count is kept per member.
  Not one that exits with EX_CONFIG (its configuration is wrong: a restart fails the same way) or
  before the cluster first served (start-up failed): ``supervise_once`` raises ``MemberFailed`` and
  the caller stops everything.
- ``stop`` sends SIGTERM to the workers first (they drain: finish in-flight work, deregister), then to
  the gateways, then to Redis, and SIGKILLs whatever is still alive after the deadline. Children also get SIGTERM
  from the kernel if this supervisor dies (PR_SET_PDEATHSIG), so no process is left behind.
- ``spec.devices`` places workers on GPUs: each worker's CUDA_VISIBLE_DEVICES starts with its own
  GPU (cluster/gpu_placement.py); a restarted worker keeps its place.
- A worker killed outright cannot unlink its /dev/shm files (KV pool, fence); their names carry its
  pid (``pdserve-<kind>-<pid>-<uuid>``, kvtransfer/shm_pool.py), so the supervisor removes them when it
  sees the process gone, before a restart and at stop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from cluster.gpu_placement import placement
from configs.schema import EX_CONFIG

PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = 1.0
SHM_DIR = "/dev/shm"


def remove_shm_segments(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the shared-memory files a (dead) worker with ``pid`` left; returns their names."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []  # no /dev/shm here: nothing was ever shared
    removed = []
    for name in names:
        parts = name.split("-")  # pdserve, kind, pid, uuid
        if len(parts) == 4 and parts[0] == "pdserve" and parts[2] == str(pid):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel for SIGTERM when the supervisor dies.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() still cleans up on a normal exit


class MemberFailed(Exception):
    """A member exited in a way no restart mends; the message names it, its exit status and why."""

    def __init__(self, name: str, returncode: int, serving: bool, last_line: str):
        why = "a configuration error" if returncode == EX_CONFIG else "before the cluster was ready"
        said = f" ({last_line})" if last_line else ""
        super().__init__(f"{name} exited with code {returncode}, {why}{said}; not restarting it")
        self.returncode = returncode


@dataclass(slots=True)
class Member:
    name: str  # "gateway", "prefill-0", "decode-1", ...
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # this member's own variables (its GPUs), over the spec's
    proc: subprocess.Popen | None = None
    restarts: int = 0
    died_at: float | None = None  # when an unexpected exit was noticed (restart after the backoff)
    last_line: str = ""  # the last line it wrote to stderr: why it stopped, when it stopped on an error
    forwarder: threading.Thread | None = None  # copies its stderr through to ours, keeping last_line


def _forward_stderr(member: Member, pipe) -> None:
    """Runs until the member exits. Keeps reading whatever happens to our own stderr: a member whose
    pipe fills up would block in its next log call."""
    for raw in pipe:
        try:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
        except (OSError, ValueError):  # our stderr closed or gone: the line is still read
            pass
        if line := raw.decode(errors="replace").strip():
            member.last_line = line[:500]
    pipe.close()


@dataclass(slots=True)
class ClusterSpec:
    config_path: str | None  # YAML handed to every member
    env: dict[str, str]  # PDSERVE_* settings shared by every member (model path, ports, keys, ...)
    num_prefill: int
    num_decode: int
    threads_per_worker: int
    # decode.idle_prefill_threads: with one prefill worker beside one decode worker, the decode worker's
    # steps take the prefill worker's threads too while none of its prompts is out there
    decode_idle_prefill_threads: int = 0
    drain_timeout_s: float = 30.0
    devices: list[str] = field(default_factory=list)  # GPUs the workers take turns over; empty: inherit
    members: list[Member] = field(default_factory=list)
    gateways: list[tuple[int, int]] = field(
        default_factory=list
    )  # (HTTP port, worker port) each; []: one, as configured
    redis_argv: list[str] | None = None  # the shared Responses store's server, when this cluster runs it
    # member name or role -> its own key file (protocol/role_keys.py), handed to that member only; {}: the env's
    role_keys: dict[str, str] = field(default_factory=dict)


def worker_argv(role: str, index: int, spec: ClusterSpec) -> list[str]:
    argv = [sys.executable, "-m", f"{role}_node"]
    if spec.config_path:
        argv += ["--config", spec.config_path]
    for key, value in (
        (f"{role}.port", 0),
        (f"{role}.http_port", 0),
        (f"{role}.worker_id", f"{role}-{index}"),
        ("engine.num_threads", spec.threads_per_worker),
    ):
        argv += ["--set", f"{key}={value}"]
    if role == "decode":
        argv += ["--set", "decode.kv_port=0"]
        if spec.decode_idle_prefill_threads:
            argv += ["--set", f"decode.idle_prefill_threads={spec.decode_idle_prefill_threads}"]
    return argv


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        gateway = [sys.executable, "-m", "gateway"] + (["--config", spec.config_path] if spec.config_path else [])
        self.members = [Member("redis", spec.redis_argv)] if spec.redis_argv else []
        if len(spec.gateways) <= 1:
            self.members += [Member("gateway", gateway + _ports(spec.gateways))]
        else:
            self.members += [Member(f"gateway-{i}", gateway + _ports([ports])) for i, ports in enumerate(spec.gateways)]
        self.members += [Member(f"prefill-{i}", worker_argv("prefill", i, spec)) for i in range(spec.num_prefill)]
        self.members += [Member(f"decode-{i}", worker_argv("decode", i, spec)) for i in range(spec.num_decode)]
        workers = [m for m in self.members if m.name.startswith(("prefill-", "decode-"))]  # the gateway needs no GPU
        gpus = placement(spec.devices, [m.name for m in workers])
        for member in workers:
            if member.name in gpus:
                member.env["CUDA_VISIBLE_DEVICES"] = gpus[member.name]
        for member in self.members:  # each member sees its own credential only (its own, else its role's)
            key = spec.role_keys.get(member.name) or spec.role_keys.get(member.name.split("-")[0])
            if key:
                member.env["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"] = key
        self._stopping = False
        self.serving = False  # set once every member has come up: from then on an exit is restarted

    def start(self) -> None:
        for member in self.members:
            self._launch(member)

    def _launch(self, member: Member) -> None:
        env = {**os.environ, **self.spec.env, "OMP_NUM_THREADS": str(self.spec.threads_per_worker), **member.env}
        member.proc = subprocess.Popen(
            member.argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent
        )
        member.died_at, member.last_line = None, ""
        member.forwarder = threading.Thread(target=_forward_stderr, args=(member, member.proc.stderr), daemon=True)
        member.forwarder.start()

    def supervise_once(self, now: float | None = None) -> list[str]:
        """Restart members that exited on their own; returns the names restarted now. Raises
        MemberFailed for an exit a restart cannot mend (EX_CONFIG, or any exit before serving)."""
        now = time.monotonic() if now is None else now
        restarted = []
        for member in self.members:
            if self._stopping or member.proc is None or member.proc.poll() is None:
                continue
            if member.died_at is None:
                member.died_at = now
                remove_shm_segments(member.proc.pid)
                if member.proc.returncode == EX_CONFIG or not self.serving:
                    member.forwarder.join(timeout=2.0)  # its last words, which end where it exited
                    raise MemberFailed(member.name, member.proc.returncode, self.serving, member.last_line)
                print(f"pdserve: {member.name} exited with code {member.proc.returncode}; restarting", flush=True)
            elif now - member.died_at >= RESTART_BACKOFF_S:
                member.restarts += 1
                self._launch(member)
                restarted.append(member.name)
        return restarted

    def stop(self) -> None:
        """Drain workers, then stop the gateway; nothing is left running afterwards."""
        self._stopping = True
        gateways = [m for m in self.members if m.name.startswith("gateway")]
        redis = [m for m in self.members if m.name == "redis"]
        workers = [m for m in self.members if m not in gateways and m not in redis]
        for group in (workers, gateways, redis):
            for member in group:
                if member.proc is not None and member.proc.poll() is None:
                    member.proc.send_signal(signal.SIGTERM)
                    member.proc.send_signal(signal.SIGCONT)  # a stopped one (SIGSTOP, ^Z) acts on it too
            deadline = time.monotonic() + self.spec.drain_timeout_s + 5.0
            for member in group:
                if member.proc is None:
                    continue
                try:
                    member.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait()
                remove_shm_segments(member.proc.pid)  # a clean exit left none; a killed one may have


def _ports(gateways: list[tuple[int, int]]) -> list[str]:
    return [arg for http, worker in gateways for arg in ("--port", str(http), "--worker-port", str(worker))]
