"""Renders a kustomization the way ``kubectl apply -k`` would, for the few features deploy/k8s uses:
``resources`` (files, and directories holding a kustomization), ``images`` (newName/newTag) and
``patches`` that are JSON 6902 operation lists (inline ``patch`` or a ``path``) on a ``target`` kind and
name. Anything else in a kustomization fails loudly, so the tests never validate a rendering that
differs from kustomize's. (kustomize itself is not installed on the CI machines.)"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: Path) -> list[dict]:
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    assert not unknown, f"{directory}: kustomize_lite does not render {sorted(unknown)}"
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs = copy.deepcopy(docs)
    for image in spec.get("images", []):
        for container in _containers(docs):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for patch in spec.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text())
        targets = [
            d
            for d in docs
            if all(d[k] == v if k == "kind" else d["metadata"][k] == v for k, v in patch["target"].items())
        ]
        assert targets, f"{directory}: patch target {patch['target']} matches nothing"
        for doc in targets:
            for op in ops:
                _apply(doc, op)
    return docs


def _containers(docs: list[dict]) -> list[dict]:
    return [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]


def _apply(doc: dict, op: dict) -> None:
    """One JSON 6902 operation (add, replace, remove); a path that does not exist fails, as in kustomize."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        if op["op"] == "add":
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] == "replace":
            node[int(last)] = op["value"]
        else:
            del node[int(last)]
    elif op["op"] == "add":
        node[last] = op["value"]
    else:
        assert last in node, f"{op['op']} {op['path']}: no such field"
        if op["op"] == "replace":
            node[last] = op["value"]
        else:
            del node[last]
