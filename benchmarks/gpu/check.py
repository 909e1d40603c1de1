"""The prepared GPU run (``scripts/gpu-check``): everything issue #32 asks of a GPU machine, in one
command under 8 minutes, figures and logs in one folder. Standard library only, so it runs before
the missing packages are installed.

On the dev machine (network):   scripts/gpu-check --fetch-wheels    -> .gpu-wheels/, sizes checked
On the GPU machine (offline):   scripts/gpu-check --out "$OUT"

1. Installs what does not import (pyzmq, starlette, uvicorn, pytest, xgrammar, ...) from .gpu-wheels/
   with pip, offline; without pip it unpacks the wheels into <out>/site and puts that on PYTHONPATH.
   xgrammar missing only means no structured outputs, which no step uses: recorded, not fatal.
2. Without CUDA: writes the report with ``"status": "no_cuda"`` and exits 3.
3. Steps, each with its log, under one deadline (``--budget-s``; a step gets what is left, at most
   its own cap): ``tests_gpu`` (tests/gpu, engine parity figures in parity.jsonl), ``kernels``
   (benchmarks.gpu.kernels), ``pd_parity`` (benchmarks.transfer.pd_parity over cuda_ipc), ``engine_throughput``
   (--quick, pdserve and transformers both on CUDA in bfloat16).
4. ``gpu-check.json``: environment, dependencies, and per step its exit status, seconds, figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "scripts" / "gpu-wheels.txt"
WHEELS = ROOT / ".gpu-wheels"
CARRY_LIMIT = 64 << 20  # what the device tool sends: the tracked and untracked files plus carried folders
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# import name -> distribution, for what the steps import (the rest of the list are their dependencies)
NEEDED = {"zmq": "pyzmq", "starlette": "starlette", "uvicorn": "uvicorn", "pytest": "pytest", "xgrammar": "xgrammar"}
OPTIONAL = {"xgrammar"}  # structured outputs: no step needs them


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: list[str]
    cap_s: float  # at most this long, less when the deadline is nearer
    figures: str | None = None  # a JSON (or JSON lines) file the step writes into the output folder


def steps(out: Path) -> list[Step]:
    py = sys.executable
    return [
        Step(
            "tests_gpu",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-rA",
                "-p",
                "no:cacheprovider",
                "tests/gpu",
                f"--junitxml={out / 'tests_gpu.xml'}",
            ],
            240,
            "parity.jsonl",
        ),
        Step("kernels", [py, "-m", "benchmarks.gpu.kernels", "--json", str(out / "kernels.json")], 60, "kernels.json"),
        Step(
            "pd_parity",
            [
                py,
                "-m",
                "benchmarks.transfer.pd_parity",
                "--device",
                "cuda",
                "--json",
                str(out / "pd_parity.json"),
                "--workdir",
                str(out / "pd_parity"),
            ],
            120,
            "pd_parity.json",
        ),
        Step(
            "engine_throughput",
            [py, "-m", "benchmarks.engine.throughput", "--quick", "--device", "cuda", "--threads", "8"],
            120,
        ),
    ]


def carried_bytes(extra: list[Path]) -> int:
    """Bytes the device tool sends: tracked files, untracked files git does not ignore, and ``extra``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    files = [ROOT / os.fsdecode(name) for name in listed if name]
    files += [f for folder in extra if folder.is_dir() for f in folder.rglob("*")]
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def fetch_wheels(wheels: Path) -> int:
    """Dev machine: the Python 3.12 manylinux wheels of scripts/gpu-wheels.txt into ``wheels``."""
    wheels.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[a for p in PLATFORMS for a in ("--platform", p)],
        "-d",
        str(wheels),
        "-r",
        str(WHEEL_LIST),
    ]
    if subprocess.run(argv).returncode != 0:
        print("gpu-check: pip download failed (see above)", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    total = carried_bytes([wheels])
    for f in sorted(wheels.glob("*.whl")):
        print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    print(
        f"gpu-check: {len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {wheels}; with the tree "
        f"{total / 2**20:.1f} MiB of the device tool's {CARRY_LIMIT >> 20} MiB"
    )
    if total > CARRY_LIMIT:
        print("gpu-check: too big to carry; drop the optional wheels (xgrammar and its dependencies)", file=sys.stderr)
        return 1
    print(
        f'next: the device tool\'s run with carry ["{wheels.relative_to(ROOT)}"] and command '
        '"bash scripts/gpu-check --out $OUT", timeout_s 540'
    )
    return 0


def importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def ensure_deps(wheels: Path, out: Path, log) -> dict[str, str]:
    """Each needed module: "present", "installed" (pip, offline) or "unpacked" (into out/site), or "missing"."""
    state = {m: "present" if importable(m) else "missing" for m in NEEDED}
    missing = [m for m, s in state.items() if s == "missing"]
    if not missing:
        return state
    if not any(wheels.glob("*.whl")):
        log(f"missing {missing} and no wheels in {wheels}: run scripts/gpu-check --fetch-wheels with PyPI at hand")
        return state
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(wheels),
        "--disable-pip-version-check",
    ]
    for module in missing:  # one at a time: an optional one failing leaves the others installed
        done = subprocess.run(
            pip + [NEEDED[module]], capture_output=True, text=True, env={**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1"}
        )
        log(f"pip install {NEEDED[module]}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        if done.returncode == 0 and importable(module):
            state[module] = "installed"
    if any(s == "missing" for s in state.values()):
        unpack_missing(wheels, out / "site", log)
        for module, s in state.items():
            if s == "missing" and importable(module):
                state[module] = "unpacked"
    return state


def unpack_missing(wheels: Path, site: Path, log) -> None:
    """No pip (or it failed): wheels are zip files; unpacking those whose top-level names do not import
    gives a folder that works on PYTHONPATH (no entry points, none needed here)."""
    site.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
            names = {t.removesuffix(".py") for t in tops if not t.endswith(".pth")}
            modules = {n for n in names if "." not in n}
            if modules and not all(importable(m) for m in modules):
                z.extractall(site)
                log(f"unpacked {wheel.name} ({', '.join(sorted(modules))})")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def cuda_info() -> dict:
    probe = (
        "import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'available': ok, "
        "'torch': torch.__version__, 'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name() if ok "
        "else None, 'count': torch.cuda.device_count() if ok else 0}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    info = json.loads(done.stdout) if done.returncode == 0 else {"available": False, "error": done.stderr[-2000:]}
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    info["python_h"] = include.exists()  # Triton compiles its launcher against it
    return info


def read_figures(path: Path):
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def run_step(step: Step, out: Path, deadline: float) -> dict:
    timeout = min(step.cap_s, deadline - time.monotonic())
    if timeout < 10:
        return {"status": "skipped", "why": "no time left under --budget-s"}
    log_path = out / f"{step.name}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PDSERVE_GPU_FIGURES": str(out / "parity.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the step's own process group: serve's workers too
            rc = proc.wait()
            rc = "timeout"
    lines = log_path.read_text(errors="replace").splitlines()
    result = {
        "status": "ok" if rc == 0 else "failed",
        "exit": rc,
        "seconds": round(time.monotonic() - started, 1),
        "log": log_path.name,
        "tail": lines[-15:],
    }
    if step.figures:
        result["figures"] = read_figures(out / step.figures)
    if step.name == "engine_throughput":
        result["figures"] = [line for line in lines if line.startswith(("vs_hf_static=", "hf ", "pdserve ", "greedy"))]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--fetch-wheels", action="store_true", help="dev machine: fetch the wheels, check the size, exit")
    p.add_argument("--out", help="figures and logs (default $OUT, else ./gpu-check-out)")
    p.add_argument("--wheels", default=str(WHEELS), help="wheel folder (default .gpu-wheels)")
    p.add_argument("--budget-s", type=float, default=450.0, help="every step done within this (default 450 s)")
    p.add_argument("--steps", help="comma-separated subset, e.g. pd_parity,kernels (default all, in order)")
    args = p.parse_args(argv)
    names = [s.name for s in steps(Path("."))]
    args.step_names = names if not args.steps else [s.strip() for s in args.steps.split(",") if s.strip()]
    if unknown := [s for s in args.step_names if s not in names]:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(Path(args.wheels))
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-check-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "gpu-check.json"
    log_file = (out / "gpu-check.log").open("a")

    def log(text: str) -> None:
        print(f"gpu-check: {text}", flush=True)
        log_file.write(text + "\n")

    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": sys.version,
        "argv": sys.argv[1:],
        "budget_s": args.budget_s,
        "steps": {},
    }
    wheels = Path(args.wheels)
    report["wheels"] = {
        "dir": str(wheels),
        "count": len(list(wheels.glob("*.whl"))),
        "mib": round(sum(f.stat().st_size for f in wheels.glob("*.whl")) / 2**20, 2),
    }
    report["deps"] = ensure_deps(wheels, out, log)
    report["structured_output"] = report["deps"]["xgrammar"] != "missing"
    required_missing = [m for m, s in report["deps"].items() if s == "missing" and m not in OPTIONAL]
    report["cuda"] = cuda_info()
    log(f"deps {report['deps']}; cuda {report['cuda']}")
    if not report["structured_output"]:
        log("xgrammar did not install: structured outputs are skipped (no step uses them)")
    status = "ok"
    if not report["cuda"]["available"]:
        status = "no_cuda"
        log("no CUDA device (torch.cuda.is_available() is False): no GPU step ran")
    elif required_missing:
        status = "missing_deps"
        log(f"cannot import {required_missing}: no step ran; fetch the wheels and carry them (docs/gpu.md)")
    else:
        for step in steps(out):
            if step.name in args.step_names:
                log(f"step {step.name} ...")
                report["steps"][step.name] = result = run_step(step, out, deadline)
                log(f"step {step.name}: {result['status']} ({result.get('seconds', 0)} s)")
                report_path.write_text(json.dumps(report, indent=2))  # a killed run still leaves the steps so far
        if any(r["status"] != "ok" for r in report["steps"].values()):
            status = "failed"
    report["status"] = status
    report_path.write_text(json.dumps(report, indent=2))
    log(f"status {status}; report {report_path}")
    log_file.close()
    return {"ok": 0, "failed": 1, "no_cuda": 3, "missing_deps": 4}[status]


if __name__ == "__main__":
    sys.exit(main())
