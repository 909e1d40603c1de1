"""deploy/compose.yaml mounts each service only its own role's key, beside roles.pub, as the Kubernetes base
does: what `pdserve keygen --out keys` writes is exactly what it mounts, and each service's mounts, made
the way docs/deploy.md says (0400), load as that role's credential and as no other role's. Where Docker
Compose v2 is installed, its own rendering (`docker compose config`) must say the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.keygen import main as keygen
from protocol.curve import ClusterKey, ClusterKeyError, PlaneSecurity

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ROLES = ("gateway", "prefill", "decode")
# ../shared/tools/docker-engine puts the Compose v2 plugin here (DOCKER_CONFIG)
COMPOSE_PLUGIN_CONFIG = "/var/lib/pdserve-docker/cli"


def compose_mounts(keys: Path) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """service -> {target file under /run/secrets: host file}, and service -> its key file's path, as the
    YAML says (the variable's default replaced by ``keys``)."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    files = {
        name: s["file"].replace("${PDSERVE_KEYS_DIR:-./keys}", str(keys)) for name, s in compose["secrets"].items()
    }
    services = compose["services"]
    mounts = {role: {m["target"]: files[m["source"]] for m in services[role]["secrets"]} for role in ROLES}
    key_files = {role: services[role]["environment"]["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"] for role in ROLES}
    return mounts, key_files


def docker_compose_mounts(keys: Path) -> tuple[dict[str, dict[str, str]], dict[str, str]] | None:
    env = {**os.environ, "PDSERVE_KEYS_DIR": str(keys)}
    if not os.path.isdir(env.get("DOCKER_CONFIG", "")) and os.path.isdir(COMPOSE_PLUGIN_CONFIG):
        env["DOCKER_CONFIG"] = COMPOSE_PLUGIN_CONFIG
    if shutil.which("docker") is None:
        return None
    out = subprocess.run(
        ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if "unknown command" in out.stderr or "is not a docker command" in out.stderr:
        return None  # docker without the Compose v2 plugin
    assert out.returncode == 0, out.stderr
    rendered = json.loads(out.stdout)
    files = {name: s["file"] for name, s in rendered["secrets"].items()}
    services = rendered["services"]
    mounts = {role: {m["target"]: files[m["source"]] for m in services[role]["secrets"]} for role in ROLES}
    key_files = {role: services[role]["environment"]["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"] for role in ROLES}
    return mounts, key_files


def test_each_service_mounts_only_its_roles_key_and_it_loads_as_that_role(tmp_path):
    keys = tmp_path / "keys"
    assert keygen(["--out", str(keys)]) == 0
    for path in keys.iterdir():
        path.chmod(0o400)  # docs/deploy.md: chmod 0400 keys/* (then chown to the containers' user)
    mounts, key_files = compose_mounts(keys)
    assert mounts == {
        role: {f"{role}.key": str(keys / f"{role}.key"), "roles.pub": str(keys / "roles.pub")} for role in ROLES
    }
    assert key_files == {role: f"/run/secrets/{role}.key" for role in ROLES}
    # keygen's output is exactly what is mounted: no file left out, none mounted that it does not write
    assert {f for m in mounts.values() for f in m.values()} == {str(p) for p in keys.iterdir()}
    rendered = docker_compose_mounts(keys)
    if rendered is not None:
        assert rendered == (mounts, key_files)
    for role in ROLES:
        run_secrets = tmp_path / role / "run" / "secrets"  # what the container sees
        run_secrets.mkdir(parents=True)
        for target, source in mounts[role].items():
            shutil.copy2(source, run_secrets / target)  # a bind mount keeps the host file's mode
        key = ClusterKey.from_file(str(run_secrets / Path(key_files[role]).name))
        assert key.role == role and set(key.server_secrets) == {role} and set(key.signing_seeds) == {role}
        for other in set(ROLES) - {role}:
            with pytest.raises(ClusterKeyError, match=f"a {role} key file given to a {other}"):
                PlaneSecurity(key, other)
