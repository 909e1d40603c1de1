"""The cluster key file as the deployments mount it (deploy/k8s, deploy/compose.yaml): readable by its
owner only, or start-up stops with one line naming the fix (protocol/key_file_mode.py). A Kubernetes
Secret with defaultMode 0400 arrives 0440 through the kubelet's atomic writer (group read for the pod's
fsGroup): that layout alone passes with a group bit. A compose file secret keeps the host file's mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.curve import ClusterKey, ClusterKeyError, new_secret_text
from tests.model_factory import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def write_key(folder, mode: int, name: str = "cluster.key") -> tuple[str, str]:
    text = new_secret_text()
    path = folder / name
    path.write_text(text)
    os.chmod(path, mode)
    return str(path), text


def kubelet_secret(tmp_path, mode: int) -> tuple[str, str]:
    """A Secret volume as the kubelet writes it: <volume>/cluster.key -> ..data/cluster.key, ..data -> a
    timestamped folder, the file in the pod's fsGroup (here this process's own group)."""
    volume = tmp_path / "volume"
    stamped = volume / "..2026_11_29_01_00_00.1"
    stamped.mkdir(parents=True)
    _, text = write_key(stamped, mode)
    os.symlink(stamped.name, volume / "..data")
    os.symlink("..data/cluster.key", volume / "cluster.key")
    return str(volume / "cluster.key"), text


@pytest.mark.parametrize("mode", [0o400, 0o600])
def test_an_owner_only_key_loads(tmp_path, mode):
    path, text = write_key(tmp_path, mode)
    assert ClusterKey.from_file(path) == ClusterKey.from_secret(bytes.fromhex(text.strip()))


@pytest.mark.parametrize("mode, who", [(0o644, "other users"), (0o604, "other users"), (0o640, "its group")])
def test_a_key_others_can_read_is_refused_naming_the_fix(tmp_path, mode, who):
    path, _ = write_key(tmp_path, mode)
    with pytest.raises(ClusterKeyError) as refused:
        ClusterKey.from_file(path)
    assert str(refused.value) == (
        f"cluster key file {path} is open to {who} (mode {mode:04o}); refusing to start: chmod 600 {path}"
    )


def test_a_kubelet_secret_under_fsgroup_loads_and_only_that_layout(tmp_path):
    path, text = kubelet_secret(tmp_path, 0o440)  # defaultMode 0400 under fsGroup
    assert ClusterKey.from_file(path) == ClusterKey.from_secret(bytes.fromhex(text.strip()))
    plain, _ = write_key(tmp_path, 0o440)  # the same mode without the kubelet's layout
    with pytest.raises(ClusterKeyError, match="open to its group"):
        ClusterKey.from_file(plain)
    writable, _ = kubelet_secret(tmp_path / "w", 0o460)  # a group that may write it is not a Secret
    with pytest.raises(ClusterKeyError, match="open to its group"):
        ClusterKey.from_file(writable)
    everyone, _ = kubelet_secret(tmp_path / "o", 0o444)  # defaultMode 0444: others too
    with pytest.raises(ClusterKeyError, match="open to other users"):
        ClusterKey.from_file(everyone)


def test_a_worker_given_a_readable_key_stops_with_one_line_and_exit_78(tmp_path):
    path, _ = write_key(tmp_path, 0o644)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "decode_node",
            "--set",
            f"model.path={tiny_model_dir('llama')}",
            "--set",
            "decode.gateway_address=tcp://127.0.0.1:9",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_TRANSFER_CLUSTER_KEY_FILE": path},
    )
    assert out.returncode == 78, out.stderr  # EX_CONFIG: no restart can help
    refusal = f"is open to other users (mode 0644); refusing to start: chmod 600 {path}"
    assert (
        [line for line in out.stderr.splitlines() if "cluster key file" in line]
        == [line for line in out.stderr.splitlines() if line.endswith(refusal)]
        != []
    )
