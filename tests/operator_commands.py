"""What an operator's Kubernetes commands make, made by the same tools on a machine without a cluster.

The commands are read from docs/deploy.md (the first ``bash`` block of its "Kubernetes" section), so
the tests run what the docs tell an operator to type, not a copy of it. Each command runs as written
(``pdserve keygen``, ``openssl``, ``rm``) or in the one form kubectl offers without an API server:

- ``kubectl create ...`` with ``--dry-run=client -o json``: kubectl builds the object it would send
  and prints it;
- ``kubectl apply -k DIR`` as ``kubectl kustomize DIR``: the objects ``apply -k`` renders and sends.

A command with no such form fails here, so the docs cannot grow a step the tests do not run. kubectl
is the real one, with its built-in kustomize (scripts/test installs it when missing)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "deploy.md"
BIN = Path(sys.executable).parent  # the venv's: `pdserve` is its console script


def kubectl(*args: str, cwd: Path = ROOT) -> str:
    """kubectl's stdout; a failure raises with its stderr (e.g. kustomize's refusal of a layout)."""
    assert shutil.which("kubectl"), "kubectl is missing: ./scripts/test installs it (apt-get install kubectl)"
    done = subprocess.run(["kubectl", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def kustomize(directory: Path) -> list[dict]:
    """The objects ``kubectl apply -k directory`` would send, rendered by kubectl's own kustomize."""
    return [d for d in yaml.safe_load_all(kubectl("kustomize", str(directory))) if d]


def documented_commands() -> list[str]:
    """The commands of docs/deploy.md's first Kubernetes block, one per ``&&``-joined step, comments cut."""
    section = DOCS.read_text().split("\n## Kubernetes\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    steps = []
    for line in block.splitlines():
        command = re.split(r"\s{2,}#", line)[0].strip()  # a comment follows two or more spaces
        steps += [c.strip() for c in command.split(" && ") if c.strip()]
    return steps


@dataclass
class Operated:
    """What the commands made: the Secrets they created and the objects ``apply -k`` sent."""

    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> key -> decoded text
    applied: dict[str, list[dict]] = field(default_factory=dict)  # the directory given to -k -> objects


def run_documented_commands(workdir: Path) -> Operated:
    """Runs every documented step in ``workdir`` (where ``cluster.key`` is written and removed)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    made = Operated()
    for step in documented_commands():
        if step.startswith("kubectl apply -k "):
            directory = step.removeprefix("kubectl apply -k ").strip()
            made.applied[directory] = kustomize(ROOT / directory)
            continue
        if step.startswith("kubectl create "):
            step += " --dry-run=client -o json"
        elif not step.startswith(("pdserve ", "rm ")):
            raise AssertionError(f"docs/deploy.md: no cluster-less form of {step!r} (tests/operator_commands.py)")
        done = subprocess.run(["bash", "-c", step], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{step}: {done.stderr}"
        if step.startswith("kubectl create "):
            secret = json.loads(done.stdout)
            assert secret["kind"] == "Secret", step
            made.secrets[secret["metadata"]["name"]] = {
                key: base64.b64decode(value).decode() for key, value in secret["data"].items()
            }
    return made
