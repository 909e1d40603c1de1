"""``pdserve serve --devices``: each worker process gets its own CUDA_VISIBLE_DEVICES, its turn's GPU
first. Checked on the launch plan and in the environment real child processes receive (no GPU needed)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from cluster.gpu_placement import parse_devices, placement
from cluster.local_cluster import ClusterSpec, LocalCluster
from cluster.serve import parse_args
from configs.loader import load_config


def test_workers_take_turns_and_see_their_own_gpu_first():
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert placement(["0", "1", "2"], names) == {
        "prefill-0": "0,1,2",
        "prefill-1": "1,2,0",
        "decode-0": "2,0,1",
        "decode-1": "0,1,2",
        "decode-2": "1,2,0",
    }
    assert placement(["GPU-aa", "GPU-bb"], ["prefill-0", "decode-0"]) == {
        "prefill-0": "GPU-aa,GPU-bb",
        "decode-0": "GPU-bb,GPU-aa",
    }
    assert placement([], names) == {}


def test_device_lists_from_the_command_line_and_the_config():
    assert parse_devices(" 0, 1,3 ") == ["0", "1", "3"]
    assert parse_devices("") == []
    with pytest.raises(ValueError, match="twice"):
        parse_devices("0,1,0")
    assert parse_args(["--devices", "2,3"]).devices == "2,3"
    assert load_config(None, env={}, overrides={"cluster.devices": "0,1"}).cluster.devices == ["0", "1"]
    assert load_config(None, env={"PDSERVE_CLUSTER_DEVICES": "4,5"}).cluster.devices == ["4", "5"]
    assert load_config(None, env={}).cluster.devices == []


def test_each_child_process_receives_its_placement(tmp_path, monkeypatch):
    """The launcher's members, each started with a stand-in command that writes the environment it got."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")  # what pdserve serve itself sees: the gateway inherits it
    spec = ClusterSpec(
        None,
        {"PDSERVE_MODEL_PATH": "m"},
        num_prefill=1,
        num_decode=2,
        threads_per_worker=1,
        drain_timeout_s=1.0,
        devices=["0", "1"],
    )
    cluster = LocalCluster(spec)
    report = (
        "import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1] + '.tmp', 'w')); "
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)"
    )  # whole files only
    for member in cluster.members:
        member.argv = [sys.executable, "-c", report, str(tmp_path / f"{member.name}.json")]
    cluster.start()
    try:
        expected = {"gateway": "9", "prefill-0": "0,1", "decode-0": "1,0", "decode-1": "0,1"}
        give_up = time.monotonic() + 60
        while not all((tmp_path / f"{name}.json").exists() for name in expected) and time.monotonic() < give_up:
            time.sleep(0.1)
        for name, devices in expected.items():
            env = json.loads((tmp_path / f"{name}.json").read_text())
            assert env["CUDA_VISIBLE_DEVICES"] == devices, name
            assert env["PDSERVE_MODEL_PATH"] == "m" and env["OMP_NUM_THREADS"] == "1"
    finally:
        cluster.stop()
    assert all(member.proc.poll() is not None for member in cluster.members)
