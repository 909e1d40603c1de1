"""scripts/cpu-emulation-check: pdserve's CPU kernels on x86 CPUs without AVX-512, under QEMU's user-mode
emulation (``qemu-x86_64 -cpu MODEL``), since no such CPU is at hand (docs/engine.md, "CPUs without AVX-512").

For each CPU model, with a fresh kernel cache and forms cache, every program of the check runs emulated:
Python (so torch's dispatch and the kernels' cpuid see the model) and the C compiler's driver (so
``-march=native`` resolves to the model, as on that CPU; the driver's own children, cc1 and the
assembler, only carry out the flags it resolved). Per model it

1. runs benchmarks/emulation/probe.py: the builds chosen at start (the compiler's reading of the CPU,
   the quantized kernels' code path, the f32 kernels' width, torch's level) and a tiny GGUF model whose
   greedy tokens on the quantized kernels must equal the dequantizing path's;
2. runs the quantized and 16-bit kernels' tests that compare with float64 references
   (tests/test_quant_kernels.py, tests/test_quant_avx2.py, tests/test_half_kernels.py; ``-k`` narrows them);
3. disassembles every library the model's cache holds: no AVX-512 register (zmm) may appear, and on a
   model without AVX no ymm either.

Needs: Linux on x86-64, ``qemu-x86_64`` 7.2 or later (Debian/Ubuntu: ``apt-get install qemu-user``; TCG
emulates AVX2 since 7.2, AVX-512 not at all), a C compiler (``cc``/``$CC``), ``objdump`` (binutils), and
the Python environment pdserve runs in. Exit: 0 every model passed, 1 a model failed, 2 something needed
is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ("tests/test_quant_kernels.py", "tests/test_quant_avx2.py", "tests/test_half_kernels.py")


@dataclass(slots=True, frozen=True)
class Expected:
    """What a model must show: the quantized kernels' code path, the levels the tests build, torch's level,
    and whether its libraries may use ymm registers (AVX). ``openblas``: the core numpy's OpenBLAS is
    told to take (``OPENBLAS_CORETYPE``), where under QEMU it picks its Haswell kernels on a CPU without
    AVX2 (SIGILL in numpy's matmuls, the tests' references; as /proc/cpuinfo, something of the host's
    reaches its detection) and the model's own CPU would run another."""

    code_path: str
    levels: tuple[str, ...]
    torch: str
    ymm: bool
    openblas: str | None = None


EXPECTED = {
    "Haswell": Expected("AVX2", ("native", "x86-64-v3"), "AVX2", ymm=True),  # AVX2, FMA, F16C
    "Skylake-Client": Expected("AVX2", ("native", "x86-64-v3"), "AVX2", ymm=True),
    # AVX without AVX2 or F16C, and SSE4.2 alone: the quantized kernels' plain C
    "SandyBridge": Expected("plain C", ("native",), "DEFAULT", ymm=True, openblas="Sandybridge"),
    "Nehalem": Expected("plain C", ("native",), "DEFAULT", ymm=False, openblas="Nehalem"),
}


@dataclass(slots=True)
class Outcome:
    model: str
    failures: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    seconds: float = 0.0

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def _requirements(qemu: str, compiler: str | None) -> list[str]:
    missing = []
    if platform.machine() != "x86_64":
        missing.append(f"an x86-64 Linux host (this is {platform.machine()})")
    version = ""
    if shutil.which(qemu):
        version = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"version (\d+)\.(\d+)", version)
    if not found or (int(found[1]), int(found[2])) < (7, 2):
        missing.append(f"{qemu} 7.2 or later (apt-get install qemu-user); found: {version.splitlines()[:1] or 'none'}")
    if compiler is None:
        missing.append("a C compiler (cc, or $CC)")
    if shutil.which("objdump") is None:
        missing.append("objdump (binutils)")
    return missing


def _environment(work: Path, qemu: str, model: str, compiler: str) -> dict[str, str]:
    """The emulated process's: its own caches, and a compiler whose driver runs on the emulated CPU too."""
    wrapper = work / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec "{qemu}" -cpu "{model}" "{compiler}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ)
    env.update(
        CC=str(wrapper),
        PDSERVE_NATIVE_CACHE_DIR=str(work / "native"),
        PDSERVE_CPU_FORMS_CACHE_DIR=str(work / "forms"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    expected = EXPECTED.get(model)
    if expected is not None and expected.openblas is not None:
        env["OPENBLAS_CORETYPE"] = expected.openblas
    return env


def _emulated(qemu: str, model: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    done = subprocess.run(
        [qemu, "-cpu", model, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    # QEMU names each CPUID bit of the model TCG lacks (tsc-deadline, TSX...) at every start
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "TCG doesn't support" not in line]
    return done.returncode, "\n".join(lines)


def _registers(library: Path) -> dict[str, int]:
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True).stdout
    return {reg: len(re.findall(rf"%{reg}\d", text)) for reg in ("zmm", "ymm")}


def run_model(model: str, args: argparse.Namespace, compiler: str) -> Outcome:
    outcome, started = Outcome(model), time.monotonic()
    expected = EXPECTED.get(model)
    with tempfile.TemporaryDirectory(prefix=f"pdserve-emulated-{model}-") as tmp:
        work = Path(tmp)
        env = _environment(work, args.qemu, model, compiler)
        probe = [args.python, "-m", "benchmarks.emulation.probe", "--qtype", args.qtype]
        rc, out = _emulated(args.qemu, model, probe, env, args.timeout)
        found = [line for line in out.splitlines() if line.startswith("PROBE ")]
        outcome.check(rc == 0 and bool(found), f"probe exit {rc}: {out[-1500:]}")
        if found:
            report = json.loads(found[-1].removeprefix("PROBE "))
            builds, run = report["builds"], report["model"]
            outcome.facts.update(builds=builds, served=run, start_log=report["start_log"])
            avx512 = [f for f in builds["native_features"] if f.startswith("__AVX512")]
            outcome.check(not avx512, f"-march=native resolved to AVX-512: {avx512}")
            outcome.check(builds["quant"] is not None and builds["native"] is not None, "a C library did not build")
            outcome.check(run["quantized_modules"] > 0, "no projection ran on the quantized kernels")
            outcome.check(run["kernel_tokens"] == run["dequantized_tokens"], "kernel tokens != dequantized tokens")
            outcome.check(any("quantized C kernels" in line for line in report["start_log"]), "no kernel log line")
            if expected is not None and builds["quant"] is not None:
                outcome.check(builds["quant"]["code_path"] == expected.code_path, f"code path {builds['quant']}")
                outcome.check(tuple(builds["levels"]) == expected.levels, f"levels {builds['levels']}")
                outcome.check(builds["torch_capability"] == expected.torch, f"torch {builds['torch_capability']}")
        if not args.no_tests:
            pytest = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
            rc, out = _emulated(args.qemu, model, pytest + (["-k", args.k] if args.k else []), env, args.timeout)
            summary = (out.strip().splitlines() or ["no output"])[-1]
            outcome.facts["tests"] = summary
            outcome.check(rc == 0, f"tests: {out[-3000:]}")
        libraries = sorted((work / "native").glob("*.so"))
        outcome.facts["libraries"] = {lib.name: _registers(lib) for lib in libraries}
        outcome.check(bool(libraries), "no library in the model's cache")
        for name, used in outcome.facts["libraries"].items():
            outcome.check(used["zmm"] == 0, f"{name} uses zmm registers (AVX-512)")
            if expected is not None and not expected.ymm:
                outcome.check(used["ymm"] == 0, f"{name} uses ymm registers (AVX) on {model}")
    outcome.seconds = time.monotonic() - started
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(EXPECTED), help="QEMU CPU models (qemu-x86_64 -cpu help)")
    parser.add_argument("--qemu", default="qemu-x86_64")
    parser.add_argument("--python", default=sys.executable, help="the Python pdserve runs in (emulated)")
    parser.add_argument("--qtype", default="Q8_0", choices=("Q8_0", "Q4_0", "Q4_1"), help="the tiny model's format")
    parser.add_argument("-k", default="", help="pytest -k for the kernel tests (default: all of both files)")
    parser.add_argument("--no-tests", action="store_true", help="the probe and the disassembly only")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per emulated program")
    parser.add_argument("--out", type=Path, help="also write the findings as JSON here")
    args = parser.parse_args(argv)
    compiler = shutil.which(os.environ.get("CC", "cc"))
    missing = _requirements(args.qemu, compiler)
    if missing:
        print("cpu-emulation-check needs: " + "; ".join(missing), file=sys.stderr)
        return 2
    # The driver's own file (cc is a chain of links), emulated; a launcher such as ccache would run it natively.
    compiler = os.path.realpath(compiler)
    if not re.search(r"gcc|clang", Path(compiler).name):
        print(f"cpu-emulation-check needs $CC to be GCC or clang itself, not {compiler}", file=sys.stderr)
        return 2
    outcomes = []
    for model in args.models.split(","):
        print(f"== {model}: running emulated (minutes)", flush=True)
        outcome = run_model(model, args, compiler)
        outcomes.append(outcome)
        quant = (outcome.facts.get("builds") or {}).get("quant") or {}
        tokens = (outcome.facts.get("served") or {}).get("kernel_tokens")
        verdict = "PASS" if not outcome.failures else "FAIL"
        print(f"{model}: {verdict} in {outcome.seconds:.0f} s; quantized kernels {quant.get('code_path')}; ", end="")
        print(f"tests {outcome.facts.get('tests', 'not run')}; kernel tokens {tokens}", flush=True)
        for line in outcome.facts.get("start_log", []):
            print(f"  start log: {line[:300]}")
        for failure in outcome.failures:
            print(f"  FAILED: {failure}")
    if args.out:
        args.out.write_text(json.dumps([vars_of(o) for o in outcomes], indent=1))
    return 0 if all(not o.failures for o in outcomes) else 1


def vars_of(outcome: Outcome) -> dict:
    return {"cpu": outcome.model, "failures": outcome.failures, "seconds": outcome.seconds, **outcome.facts}


if __name__ == "__main__":
    sys.exit(main())
