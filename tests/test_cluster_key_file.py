"""The cluster key file as the deployments mount it (deploy/k8s, deploy/compose.yaml): a Kubernetes Secret
with defaultMode 0400 arrives 0440 (the kubelet adds group read for the pod's fsGroup), a compose file
secret keeps the host file's mode. Group-readable is how a non-root pod reads its Secret: no warning;
readable by every user is worth one."""

from __future__ import annotations

import logging
import os

from protocol.curve import ClusterKey, new_secret_text


def load(tmp_path, mode: int, caplog) -> tuple[ClusterKey, list[str]]:
    text = new_secret_text()
    path = tmp_path / f"cluster-{mode:o}.key"
    path.write_text(text)
    os.chmod(path, mode)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="protocol.curve"):
        key = ClusterKey.from_file(str(path))
    assert key == ClusterKey.from_secret(bytes.fromhex(text.strip()))
    return key, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_owner_and_group_readable_keys_load_quietly(tmp_path, caplog):
    for mode in (0o400, 0o600, 0o440):  # 0440: a 0400 Secret under fsGroup
        assert load(tmp_path, mode, caplog)[1] == [], oct(mode)


def test_a_world_readable_key_loads_with_a_warning(tmp_path, caplog):
    [warning] = load(tmp_path, 0o644, caplog)[1]
    assert "readable by other users (mode 644)" in warning
