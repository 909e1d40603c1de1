"""A worker says what it is doing while it starts: the model it loads (path, size, time, memory), the
CPU matmul forms it times (with progress) or finds in the cache, and its KV pool in blocks and tokens."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from cluster.keygen import write_private_key
from tests.cluster_harness import free_port
from tests.model_factory import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
NUM_BLOCKS = 48
BLOCK = 16


def start_decode_worker(forms_cache: Path) -> list[str]:
    """The log lines of a decode worker until it is READY (then it is stopped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PDSERVE_CPU_FORMS_CACHE_DIR"] = str(forms_cache)
    env["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"] = write_private_key(str(forms_cache.parent))  # CURVE is on by default
    argv = [
        sys.executable,
        "-m",
        "decode_node",
        "--set",
        f"model.path={tiny_model_dir('llama')}",
        "--set",
        f"engine.num_kv_blocks={NUM_BLOCKS}",
        "--set",
        f"engine.block_size={BLOCK}",
        "--set",
        "engine.num_threads=1",
        "--set",
        "decode.worker_id=decode-logs",
        "--set",
        "decode.kv_port=0",
        "--set",
        "decode.http_port=0",
        "--set",
        f"decode.gateway_address=tcp://127.0.0.1:{free_port()}",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("READY"):
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert lines and lines[-1].startswith("READY"), "\n".join(lines)
    return lines


def checkpoint_parameters(model: Path) -> int:
    """Elements stored in the checkpoint (a tied LM head is stored once, as the engine holds it)."""
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (safe_open is not iterable)


def logged(lines: list[str], pattern: str) -> list[re.Match]:
    """Matches of ``pattern`` in the worker's own log lines (its format: role[worker id] logger: message)."""
    found = [re.search(pattern, line) for line in lines if "decode[decode-logs]" in line]
    return [m for m in found if m]


def test_a_worker_logs_its_start_and_finds_the_forms_cache_the_second_time(tmp_path):
    model = tiny_model_dir("llama")
    hf = json.loads((model / "config.json").read_text())
    first = start_decode_worker(tmp_path / "forms")
    assert logged(first, rf"loading model {re.escape(str(model))} \(dtype auto, cpu, 1 threads\)")
    [loaded] = logged(
        first,
        r"loaded llama: (\d+) layers, ([\d,]+) parameters, torch.float32 \(\d+ MiB\) "
        r"in [\d.]+ s; resident memory \d+ MiB",
    )
    assert int(loaded.group(1)) == hf["num_hidden_layers"]
    assert int(loaded.group(2).replace(",", "")) == checkpoint_parameters(model)
    progress = logged(first, r"timing CPU matmul forms: (\d+)/(\d+) passes \((\w+) at \d+ rows\), [\d.]+ s")
    assert [m.group(3) for m in progress][-1] == "c" and progress[-1].group(1) == progress[-1].group(2)
    assert [int(m.group(1)) for m in progress] == sorted(int(m.group(1)) for m in progress)  # counting up
    assert logged(first, r"timed CPU matmul forms in [\d.]+ s")
    assert not logged(first, "found in the cache")
    assert logged(
        first,
        rf"KV pool: {NUM_BLOCKS} blocks of {BLOCK} tokens \({NUM_BLOCKS * BLOCK} tokens\), "
        r"[\d.]+ MiB torch.float32; engine ready in [\d.]+ s",
    )
    assert list((tmp_path / "forms").glob("forms-*.json"))

    second = start_decode_worker(tmp_path / "forms")  # the next worker on this machine
    assert logged(second, r"CPU matmul forms found in the cache .*forms-\w+\.json: no timing")
    assert not logged(second, "timing CPU matmul forms")
