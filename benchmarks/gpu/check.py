"""The prepared GPU run (``scripts/gpu-check``): what issues #32, #48 and #45 ask of a GPU machine, in one
command within 7 minutes of GPU machine time, installs included, figures and logs in one folder.
Standard library only, so it runs before the missing packages are installed.

On the dev machine (network):   scripts/gpu-check --fetch-wheels    -> .gpu-wheels/, sizes checked
                                scripts/gpu-check --stage-model     -> .gpu-model/ (SmolLM2 in three parts)
On the GPU machine (offline):   scripts/gpu-check --out "$OUT"      (three calls when the model travels: docs/gpu.md)

1. Installs what does not import (pyzmq, starlette, uvicorn, pytest, xgrammar, ...) from .gpu-wheels/
   with pip, offline; without pip it unpacks the wheels into <out>/site and puts that on PYTHONPATH.
   xgrammar missing only means no structured outputs, which no step uses: recorded, not fatal.
2. Without CUDA: writes the report with ``"status": "no_cuda"`` and exits 3.
3. Steps, each with its log, under one deadline (``--budget-s``; a step gets what is left, at most
   its own cap): ``tests_gpu`` (tests/gpu, one JSON line per test in tests_gpu.jsonl as it ends, so a
   timeout still says what passed; engine parity figures in parity.jsonl), ``kernels``
   (benchmarks.gpu.kernels), ``scale`` (benchmarks.gpu.scale, the Llama-3-8B shape with dummy weights),
   ``pd_parity`` (benchmarks.transfer.pd_parity over cuda_ipc), ``engine_throughput`` (--quick), and
   ``kv_dtypes`` (issue #45: int8 and fp8 KV against bfloat16 KV on SmolLM2-135M, whose GGUF the three
   calls' parts are joined into first, benchmarks/gpu/model_stage.py).
   A step that exits 0 without its figures file fails. ``--dry-run`` lists the plan and its budget
   and checks that each step starts (entry points parse their arguments, tests/gpu collects).
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

from benchmarks.gpu import model_stage

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/gpu/check.py -> the repository
WHEEL_LIST = ROOT / "scripts" / "gpu-wheels.txt"
WHEELS = ROOT / ".gpu-wheels"
CARRY_LIMIT = 64 << 20  # what the device tool sends: the tracked and untracked files plus carried folders
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# import name -> distribution, for what the steps import (the rest of the list are their dependencies)
NEEDED = {
    "zmq": "pyzmq",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "pytest": "pytest",
    "xgrammar": "xgrammar",
    "gguf": "gguf",  # GGUF files: tests/gpu/test_gguf_cuda.py, the kv_dtypes step's SmolLM2
}
OPTIONAL = {"xgrammar"}  # structured outputs: no step needs them


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: list[str]
    cap_s: float  # at most this long, less when the deadline is nearer
    figures: str | None = None  # a JSON (or JSON lines) file the step writes into the output folder
    default: bool = True  # in the plan unless --steps names the steps


# The whole check, installs included, within 7 minutes of GPU machine time: #48's 5 minutes plus
# #45's kv_dtypes step and 8-bit KV tests. With a machine's start (1-2 minutes) that leaves a session's
# 15 minutes of device time room to rerun a failed step.
DEFAULT_BUDGET_S = 415.0
INSTALL_ALLOWANCE_S = 20.0  # offline pip of ~10 MiB of wheels, measured before the steps' caps


def steps(out: Path) -> list[Step]:
    """In order of what the issue needs most; each capped, the later ones cut first by the deadline."""
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
            130,
            "parity.jsonl",
        ),
        Step(
            "kv_dtypes",
            [
                py,
                "-m",
                "benchmarks.gpu.kv_dtypes",
                "--device",
                "cuda",
                "--check",
                "--json",
                str(out / "kv_dtypes.json"),
            ],
            90,  # three engines over the GGUF (dequantized on the CPU), the 8-bit kernels compiled
            "kv_dtypes.json",
        ),
        Step("kernels", [py, "-m", "benchmarks.gpu.kernels", "--json", str(out / "kernels.json")], 45, "kernels.json"),
        Step(
            "scale",
            [py, "-m", "benchmarks.gpu.scale", "--shape", "llama3-8b", "--json", str(out / "scale.json")],
            95,
            "scale.json",
        ),
        Step(
            "pd_parity",
            [
                py,
                "-m",
                "benchmarks.transfer.pd_parity",
                "--device",
                "cuda",
                "--quick",
                "--json",
                str(out / "pd_parity.json"),
                "--workdir",
                str(out / "pd_parity"),
            ],
            35,
            "pd_parity.json",
        ),
        # The 57 M model's throughput is Python-bound (#48); scale measures what the GPU does. On request.
        Step(
            "engine_throughput",
            [py, "-m", "benchmarks.engine.throughput", "--quick", "--device", "cuda", "--threads", "8"],
            120,
            default=False,
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
        "PDSERVE_GPU_RESULTS": str(out / "tests_gpu.jsonl"),  # one line per test as it ends (tests/gpu/conftest.py)
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
        if result["figures"] is None and rc == 0:  # a step that claims success must leave its figures
            result["status"] = "failed"
            result["why"] = f"{step.figures} not written"
    if step.name == "tests_gpu":
        result["tests"] = read_figures(out / "tests_gpu.jsonl") or []
        result["passed"] = sum(t["outcome"] == "passed" for t in result["tests"])
        result["failed_tests"] = [t["test"] for t in result["tests"] if t["outcome"] == "failed"]
    if step.name == "engine_throughput":
        result["figures"] = [line for line in lines if line.startswith(("vs_hf_static=", "hf ", "pdserve ", "greedy"))]
    return result


def plan(step_names: list[str], budget_s: float, out: Path) -> dict:
    """The steps that would run, their caps, and whether installs plus caps fit the budget."""
    chosen = [s for s in steps(out) if s.name in step_names]
    total = INSTALL_ALLOWANCE_S + sum(s.cap_s for s in chosen)
    return {
        "budget_s": budget_s,
        "install_allowance_s": INSTALL_ALLOWANCE_S,
        "steps": [{"name": s.name, "cap_s": s.cap_s, "argv": s.argv[1:], "figures": s.figures} for s in chosen],
        "total_s": total,
        "fits": total <= budget_s,
    }


def startable(step: Step) -> tuple[bool, str]:
    """Without a GPU: the step's entry point parses its own arguments (python -m X --help), and pytest
    collects tests/gpu; what would stop the GPU run before its first figure."""
    argv = (
        step.argv[:3] + ["--collect-only", "-q", "tests/gpu"]
        if step.name == "tests_gpu"
        else step.argv[:3] + ["--help"]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode == 0, (done.stdout + done.stderr).strip().splitlines()[-1:][
        0
    ] if done.stdout or done.stderr else ""


def dry_run(args: argparse.Namespace) -> int:
    out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-check-out").resolve()
    the_plan = plan(args.step_names, args.budget_s, out)
    ok = the_plan["fits"]
    print(f"gpu-check plan (budget {args.budget_s:g} s, installs {INSTALL_ALLOWANCE_S:g} s):")
    for step in steps(out):
        if step.name in args.step_names:
            started, last = startable(step)
            ok &= started
            print(f"  {step.name:<18} cap {step.cap_s:>4g} s  {'starts' if started else 'DOES NOT START'}  {last}")
    print(f"  total {the_plan['total_s']:g} s of {args.budget_s:g}: {'fits' if the_plan['fits'] else 'OVER BUDGET'}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--fetch-wheels", action="store_true", help="dev machine: fetch the wheels, check the size, exit")
    p.add_argument("--stage-model", action="store_true", help="dev machine: SmolLM2 into .gpu-model/ in parts, exit")
    p.add_argument("--out", help="figures and logs (default $OUT, else ./gpu-check-out)")
    p.add_argument("--wheels", default=str(WHEELS), help="wheel folder (default .gpu-wheels)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"installs and every step done within this (default {DEFAULT_BUDGET_S:g} s)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the plan with budgets and check each step starts")
    p.add_argument("--steps", help="comma-separated subset, e.g. pd_parity,kernels (default all, in order)")
    args = p.parse_args(argv)
    names = [s.name for s in steps(Path("."))]
    defaults = [s.name for s in steps(Path(".")) if s.default]
    args.step_names = defaults if not args.steps else [s.strip() for s in args.steps.split(",") if s.strip()]
    if unknown := [s for s in args.step_names if s not in names]:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(Path(args.wheels))
    if args.stage_model:
        wheels = Path(args.wheels)
        return model_stage.main(carried_bytes([wheels]), CARRY_LIMIT)
    if args.dry_run:
        return dry_run(args)
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
    report["model"] = model_stage.ensure()  # the kv_dtypes step's SmolLM2: given, installed, joined or missing
    report["cuda"] = cuda_info()
    log(f"deps {report['deps']}; model {report['model']}; cuda {report['cuda']}")
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
