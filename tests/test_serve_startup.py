"""Bad input at start-up fails fast with one line; the supervisor does not restart what a restart cannot
mend; SIGTERM stops ``pdserve serve`` even while a member crash-loops. Real processes throughout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster.keygen import write_private_key
from configs.schema import EX_CONFIG
from tests.cluster_harness import ServeProcess, free_port
from tests.model_factory import tiny_model_dir
from tests.netns import poll_until

ROOT = Path(__file__).resolve().parents[1]


def offline_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return {**env, "HF_HUB_OFFLINE": "1", "PDSERVE_GATEWAY_WORKER_PORT": str(free_port()), **extra}


def serve(*args: str, timeout_s: float = 10.0) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    argv = [sys.executable, "-m", "cluster", "serve", "--port", str(free_port()), *args]
    result = subprocess.run(argv, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout_s)
    return result, time.monotonic() - started


def no_config_dir(tmp_path: Path) -> Path:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    return tmp_path / "weights"


def bert_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bert"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    return path


BAD_MODELS = {  # how it is given -> the one line every role prints for it
    "missing path": (lambda tmp: "/nonexistent/dir", "model path '/nonexistent/dir' does not exist"),
    "hub id offline": (
        lambda tmp: "Org/Name",
        "model 'Org/Name' is not a local directory and the Hugging Face hub "
        "cannot provide it (HF_HUB_OFFLINE is set): ",
    ),
    "no config.json": (lambda tmp: str(no_config_dir(tmp)), "has no config.json (not a Hugging Face checkpoint)"),
    "unsupported architecture": (
        lambda tmp: str(bert_dir(tmp)),
        "unsupported architecture ['BertModel'] "
        "(model_type 'bert'); pdserve runs LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_serve_fails_fast_with_one_line(tmp_path, case):
    given, expected = BAD_MODELS[case]
    model = given(tmp_path)
    result, seconds = serve("--model", model)
    assert result.returncode == EX_CONFIG, result.stderr
    assert seconds < 10
    [line] = result.stderr.splitlines()
    assert line.startswith("pdserve serve: ") and expected in line, line
    assert model in line


@pytest.mark.parametrize(
    "role, argv",
    [
        ("gateway", lambda model: ["-m", "gateway", "--model", model, "--port", "0", "--worker-port", "0"]),
        ("prefill", lambda model: ["-m", "prefill_node", "--set", f"model.path={model}"]),
        ("decode", lambda model: ["-m", "decode_node", "--set", f"model.path={model}"]),
    ],
)
@pytest.mark.parametrize("case", ["hub id offline", "unsupported architecture"])
def test_every_role_resolves_the_model_the_same_way(tmp_path, role, argv, case):
    given, expected = BAD_MODELS[case]
    key = write_private_key(str(tmp_path))  # a role alone needs the cluster key before anything else
    result = subprocess.run(
        [sys.executable, *argv(given(tmp_path))],
        cwd=ROOT,
        env=offline_env(PDSERVE_TRANSFER_CLUSTER_KEY_FILE=key),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EX_CONFIG, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "Kubernetes" not in line]
    assert line.startswith(f"pdserve {role}: ") and expected in line, result.stderr


def test_gateway_resolves_a_hub_id_without_torch(tmp_path):
    code = (
        "import sys; from gateway.__main__ import main; rc = main(['--model', 'Org/Name']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == EX_CONFIG, result.stderr


def test_a_member_that_fails_its_configuration_is_not_restarted(tmp_path):
    # Valid for the supervisor and the gateway; the workers refuse it once they read the model.
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"max_model_len": 100000}}))
    result, seconds = serve(
        "--model",
        str(tiny_model_dir("llama")),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--config",
        str(config),
        timeout_s=180,
    )
    assert result.returncode == EX_CONFIG, result.stderr
    assert "exceeds the model's 2048 positions" in result.stderr
    # The member's own line, then the supervisor's, which repeats it: the last line says it all.
    last = result.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"pdserve serve: (prefill|decode)-0 exited with code 78, a configuration error \(pdserve "
        r"(prefill|decode): max_model_len 100000 exceeds the model's 2048 positions\); not restarting "
        r"it; every member stopped",
        last,
    ), result.stderr
    assert "restarting" not in result.stdout


# A hang detector, not a speed check: past the longest a stop may take when a member does not go on
# its own (drain_timeout_s, 30 s by default, + 5 s of grace per group, workers then gateways: 70 s,
# after which the supervisor SIGKILLs it) and past any start on a loaded machine; far short of the
# --ready-timeout a stop while starting must not wait for.
HANG_S = 300.0


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_sigterm_stops_serve_while_a_member_crash_loops(tmp_path):
    cluster = ServeProcess(
        tiny_model_dir("llama"), tmp_path, num_prefill=0, num_decode=1, decode={"drain_timeout_s": 5.0}
    )
    members = children_of(cluster.proc.pid)
    [gateway] = [pid for pid in members if "-m gateway" in cmdline(pid)]
    os.kill(gateway, signal.SIGKILL)
    # Its HTTP port taken: every new gateway fails to bind and exits, and the supervisor starts another.
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        cluster.wait_until(lambda: _bound(squatter, cluster.port), "the gateway's port taken", timeout_s=10)
        squatter.listen()
        cluster.wait_until(
            lambda: sum("gateway exited" in line for line in cluster.log) >= 3,
            "the gateway crash-looping",
            timeout_s=HANG_S,  # each new gateway imports, fails to bind and exits: long on a busy machine
            poll_s=0.2,
        )
        members = children_of(cluster.proc.pid)
        cluster.proc.send_signal(signal.SIGTERM)
        assert cluster.proc.wait(timeout=HANG_S) == 0  # it stopped (it used to restart the gateway for ever)
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def _running_workers(supervisor: int) -> tuple[list[int], list[int]] | None:
    """(every member, the two workers) once both workers run as themselves: a child is listed from its
    fork, but shows the supervisor's own command line until it has exec'd ``python -m prefill_node``
    (a while on a busy machine)."""
    members = children_of(supervisor)
    workers = [pid for pid in members if "_node" in cmdline(pid)]
    return (members, workers) if len(workers) == 2 else None


def test_sigterm_while_starting_stops_serve_at_once(tmp_path):
    # Workers that never come up (stopped here before they register) kept `pdserve serve` waiting for
    # --ready-timeout; SIGTERM now ends it at once, stopped members included.
    argv = [
        sys.executable,
        "-m",
        "cluster",
        "serve",
        "--model",
        str(tiny_model_dir("llama")),
        "--port",
        str(free_port()),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--ready-timeout",
        "3600",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    workers: list[int] = []
    try:
        assert proc.stdout.readline().startswith("pdserve: gateway http://")  # just before the members start
        running = poll_until(lambda: _running_workers(proc.pid), HANG_S, poll_s=0.05)
        assert running, [cmdline(pid) for pid in children_of(proc.pid)]
        members, workers = running
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == 0  # it waited for no worker to register (--ready-timeout 3600 s)
    finally:
        if proc.poll() is None:  # a failed test leaves nothing running
            proc.kill()
            proc.wait()
        for pid in workers:  # the kernel's SIGTERM on the supervisor's death waits on a stopped process
            if Path(f"/proc/{pid}").exists() and "_node" in cmdline(pid):
                os.kill(pid, signal.SIGKILL)
    assert "ready" not in proc.stdout.read()
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
