"""The lock files in requirements/: every Python package's exact version and its file's hash.

    python scripts/lock.py write REPORT DIR PYTEST_ARGS...   # in the venv scripts/lock-update tests
    python scripts/lock.py pins LOCK           # its name==version lines, as pip constraints
    python scripts/lock.py interpreter LOCK    # exit 1 unless this Python is the one the lock is for
    python scripts/lock.py extras LOCK         # installed packages the lock does not hold, one a line
    python scripts/lock.py check LOCK [--subset]

Three locks, all from one tested environment (a fresh venv with pdserve's dev and otlp-grpc extras):

- dev-cpu.txt: that whole environment (CPython 3.11, Linux x86_64): scripts/test and CI install it;
- runtime-cpu.txt: the part pdserve and its otlp-grpc extra need: scripts/run and the CPU image;
- runtime-cuda.txt: the same packages for the CUDA image's CPython 3.12 (Ubuntu 24.04), at the same
  versions, with the hashes of their cp312 wheels, and torch's CUDA build of the same release. torch's
  CUDA libraries are not listed: that build pins each one exactly (==) itself, so torch's pin fixes
  them, and they come from the PyTorch index, which the machines that make the lock cannot reach.

Only the standard library is imported at the top, so ``interpreter`` runs before any venv exists."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TARGET = "CPython 3.11, Linux x86_64"
CUDA_PYTHON = "3.12"  # Ubuntu 24.04's python3, in deploy/Dockerfile's CUDA base image
# the wheel tags Ubuntu 24.04 (glibc 2.39) runs, best first, as its pip ranks them
CUDA_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + ["manylinux2014_x86_64"]
CUDA_TORCH = "+cu128"  # the PyTorch index of the CUDA build (docs/deploy.md: TORCH_INDEX_URL)
OWN = {"pdserve", "pip"}  # the project itself (installed editable, no hash) and the installer


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read(lock: Path) -> dict[str, str]:
    """name -> version of each pin in a lock file."""
    pins = {}
    for line in Path(lock).read_text().splitlines():
        if line and not line.startswith(("#", " ")):
            name, version = line.split(" ")[0].split("==")
            pins[canonical(name)] = version
    return pins


def target(lock: Path) -> str:
    return re.search(r"^# for: (.+)$", Path(lock).read_text(), re.M).group(1)


def this_interpreter() -> str:
    major, minor = sys.version_info[:2]
    return f"{platform.python_implementation()} {major}.{minor}, {platform.system()} {platform.machine()}"


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def check(lock: Path, subset: bool) -> list[str]:
    """What differs between this environment and the lock (only what the lock holds, with ``subset``)."""
    want, have = read(lock), installed()
    wrong = [f"{n}: {have.get(n, 'missing')}, locked {v}" for n, v in sorted(want.items()) if have.get(n) != v]
    if not subset:
        wrong += [f"{n}: {have[n]}, not in the lock" for n in sorted(set(have) - set(want) - OWN)]
    return wrong


def write_lock(path: Path, header: str, pins: dict[str, tuple[str, list[str]]]) -> None:
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    for name in sorted(pins):
        version, hashes = pins[name]
        lines.append(f"{name}=={version}" + "".join(f" \\\n    --hash=sha256:{h}" for h in hashes))
    path.write_text("\n".join(lines) + "\n")


def reported(report: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, [sha256]) of what pip's --report says it installed (the project excluded)."""
    pins = {}
    for item in json.loads(Path(report).read_text())["install"]:
        name = canonical(item["metadata"]["name"])
        if name in OWN:
            continue
        archive = item["download_info"].get("archive_info", {})
        assert "sha256" in archive.get("hashes", {}), f"{name}: pip reported no sha256 for its file"
        pins[name] = (item["metadata"]["version"], [archive["hashes"]["sha256"]])
    return pins


def runtime_closure(environment: dict[str, str]) -> set[str]:
    """pdserve's dependencies and its otlp-grpc extra, and theirs, for the given marker environment,
    read from what this venv installed (the same release's metadata on every platform)."""
    from packaging.requirements import Requirement  # the venv's own (transformers needs it)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["otlp-grpc"]]
    todo = [r for r in roots if r.marker is None or r.marker.evaluate({**environment, "extra": ""})]
    seen: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = canonical(requirement.name)
        visits = [(name, extra) for extra in ("", *sorted(requirement.extras))]
        if all(v in seen for v in visits):
            continue
        seen.update(visits)
        for text in metadata.distribution(name).requires or []:
            needed = Requirement(text)
            marker = needed.marker
            if marker is None or any(marker.evaluate({**environment, "extra": e}) for _, e in visits):
                todo.append(needed)
    return {name for name, _ in seen}


def cuda_environment() -> dict[str, str]:
    from packaging.markers import default_environment

    return {
        **default_environment(),
        "python_version": CUDA_PYTHON,
        "python_full_version": f"{CUDA_PYTHON}.0",
        "implementation_version": f"{CUDA_PYTHON}.0",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "sys_platform": "linux",
    }


def cuda_hashes(pins: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """The cp312 wheel pip would pick for each pin, and its hash, without downloading it: a dry run."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--no-deps"]
        pip += ["--only-binary=:all:", "--python-version", CUDA_PYTHON]
        pip += [arg for tag in CUDA_PLATFORMS for arg in ("--platform", tag)]
        pip += ["--target", f"{tmp}/target", "--report", f"{tmp}/report.json", "-r", f"{tmp}/pins.txt"]
        subprocess.run(pip, check=True)
        return reported(Path(tmp) / "report.json")


HEADER = """Generated by scripts/lock-update from pyproject.toml, after the tests passed on exactly these
versions; do not edit by hand (docs/contributing.md: moving the lock forward).
tested: {tested}
for: {target}
{what}
"""


def write(report: Path, out: Path, tested: str) -> None:
    # the CPU image's Python too (deploy/Dockerfile: python:3.11-slim): the hashes are of its wheels
    assert this_interpreter() == CPU_TARGET, f"make the lock with {CPU_TARGET}, not {this_interpreter()}"
    dev = reported(report)
    unreported = set(installed()) - set(dev) - OWN
    assert not unreported, f"installed before pip's report began, so not hashed: {sorted(unreported)}"
    out.mkdir(parents=True, exist_ok=True)
    what = "Everything scripts/test and CI install: pdserve's dependencies and its dev and otlp-grpc extras."
    write_lock(out / "dev-cpu.txt", HEADER.format(tested=tested, target=CPU_TARGET, what=what), dev)
    from packaging.markers import default_environment

    runtime = {n: dev[n] for n in runtime_closure(default_environment())}
    what = "pdserve's dependencies and its otlp-grpc extra: scripts/run and deploy/Dockerfile's CPU image."
    write_lock(out / "runtime-cpu.txt", HEADER.format(tested=tested, target=CPU_TARGET, what=what), runtime)
    names = runtime_closure(cuda_environment())
    missing = names - set(dev)
    assert not missing, f"needed on Python {CUDA_PYTHON} only, so never installed and tested: {sorted(missing)}"
    cuda = cuda_hashes({n: dev[n][0] for n in sorted(names - {"torch"})})
    cuda["torch"] = (dev["torch"][0].split("+")[0] + CUDA_TORCH, [])
    what = (
        "deploy/Dockerfile's CUDA image: the packages and versions of runtime-cpu.txt, as cp312 wheels.\n"
        "torch: the CUDA build of the tested release, from the PyTorch index; it pins its CUDA libraries."
    )
    header = HEADER.format(tested=tested, target=f"CPython {CUDA_PYTHON}, Linux x86_64", what=what)
    write_lock(out / "runtime-cuda.txt", header, cuda)


def main(argv: list[str]) -> int:
    command, lock = argv[0], Path(argv[1])
    if command == "write":
        write(lock, Path(argv[2]), tested=" ".join(argv[3:]))
    elif command == "pins":
        print("".join(f"{n}=={v}\n" for n, v in read(lock).items()), end="")
    elif command == "interpreter":
        if target(lock) != this_interpreter():
            print(f"{lock} is for {target(lock)}; this is {this_interpreter()} ({sys.executable})", file=sys.stderr)
            return 1
    elif command == "extras":
        print("\n".join(sorted(set(installed()) - set(read(lock)) - OWN)))
    elif command == "check":
        if wrong := check(lock, subset="--subset" in argv):
            print(f"this environment is not {lock}:\n  " + "\n  ".join(wrong), file=sys.stderr)
            return 1
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
