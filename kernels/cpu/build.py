"""Compiling the C kernels into a shared library for this very CPU, kept in a cache on disk.

A library is compiled with the machine's C compiler (GCC or clang) for this CPU (``-march=native``,
``-mcpu=native`` on Arm) into ``~/.cache/pdserve/native/`` (``$PDSERVE_NATIVE_CACHE_DIR`` overrides),
once per source, compiler, torch and CPU: later processes load the cached file (a build takes ~1 s; a
library unused for 30 days is removed by the next build there). With GCC it links the OpenMP runtime
torch ships (``torch/lib/libgomp.so.1``) when there is one, so the kernels' threads are torch's threads
rather than a second pool competing for the same cores. ``kernels/cpu/native.py`` says what it builds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu import trusted_cache

_FLAGS = ("-O3", "-fno-math-errno", "-Wno-psabi", "-shared", "-fPIC")
# Builds for other sources, compilers or torch versions pile up in the cache as pdserve is upgraded. A
# library is touched whenever it is used, and a new build removes those unused for this long (a
# process that has one loaded keeps its mapping: unlinking does not unmap it).
STALE_AFTER_S = 30 * 24 * 3600


@dataclass(slots=True, frozen=True)
class Sources:
    """One library's C sources and the headers they include; ``name`` prefixes its builds in the cache."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    flags: tuple[str, ...] = ()  # the library's own, after the common ones


@dataclass(slots=True, frozen=True)
class Variant:
    """One way to build the library: with OpenMP threads or without; ``lanes`` forces the vector width
    (4, 8 or 16 floats) where the default is the hardware's (the tests build every width); ``defines``
    are macros a library's sources choose a code path by (quant.c's plain-C build); ``arch`` the
    instruction-set flags in place of ``-march=native`` (``("-march=x86-64-v3",)``: the AVX2 build the
    tests run on an AVX-512 machine). They are part of the command, so of the cache key: variants
    never share a file."""

    openmp: bool = True
    lanes: int | None = None
    defines: tuple[str, ...] = ()
    arch: tuple[str, ...] = ()


THREADED, SERIAL = Variant(openmp=True), Variant(openmp=False)


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_NATIVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve" / "native"


def _torch_libgomp() -> Path | None:
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return path if path.exists() else None


def _arch(variant: Variant) -> tuple[str, ...]:
    # Arm compilers spell "this very CPU" -mcpu=native; x86 ones -march=native.
    native = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
    return variant.arch or (native,)


def _command(library: Sources, compiler: str, variant: Variant, output: str) -> list[str]:
    arch = list(_arch(variant))
    flags = [*_FLAGS, *library.flags, *arch] + ([f"-DLANES={variant.lanes}"] if variant.lanes else [])
    flags += [f"-D{name}" for name in variant.defines]
    link = []
    if variant.openmp:
        flags.append("-fopenmp")
        gomp = _torch_libgomp()
        if gomp is not None:  # else torch linked the system's runtime (or none): -fopenmp picks it
            link = [str(gomp), f"-Wl,-rpath,{gomp.parent}"]
    return [compiler, *flags, *map(str, library.sources), "-o", output, *link]


@functools.cache  # read at every build lookup and forms-cache key; the CPU does not change under us
def cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux; Arm's features and part number), else what
    ``platform`` knows of it: what a ``-march=native`` build, or a timing, is only valid for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    seen = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "flags", "Features", "CPU part"):
            seen.setdefault(name.strip(), value.strip())
    return json.dumps(seen, sort_keys=True) if seen else f"{platform.machine()} {platform.processor()}"


@functools.cache  # one compiler run per process and flags; the CPU and the compiler do not change under us
def target_macros(compiler: str, arch: tuple[str, ...]) -> str:
    """What ``compiler`` predefines for ``arch`` (``__AVX2__``, ``__AVX512F__``, ``__GNUC__``...): the
    instruction set a build with those flags may use, resolved as the build resolves ``-march=native`` (the
    compiler asks the CPU itself, through cpuid and the OS's saved state). /proc/cpuinfo cannot say this:
    under user-mode emulation (qemu-x86_64 -cpu Haswell, scripts/cpu-emulation-check) it describes the
    host. Empty where the compiler fails (the build then fails and says why)."""
    command = [compiler, *arch, "-dM", "-E", "-x", "c", os.devnull]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return ""
    return "\n".join(sorted(done.stdout.splitlines())) if done.returncode == 0 else ""


def native_features(compiler: str) -> frozenset[str]:
    """The macros ``compiler`` defines to 1 for this CPU's native build (``__AVX2__``, ``__AVXVNNI__``...)."""
    words = (line.split() for line in target_macros(compiler, _arch(Variant())).splitlines())
    return frozenset(w[1] for w in words if len(w) == 3 and w[0] == "#define" and w[2] == "1")


def library_path(library: Sources, compiler: str, variant: Variant) -> Path:
    """Where the build of ``library`` by ``compiler`` as ``variant`` for this machine lives in the cache."""
    recipe = " ".join(_command(library, compiler, variant, "")).encode()
    code = [path.read_bytes() for path in library.sources + library.headers]
    # The CPU too: a home directory shared by machines of other CPUs (NFS, one volume for a node pool)
    # must not hand one of them a library built for instructions it lacks. By what the compiler makes of
    # the flags (the instruction set, and its own version) besides /proc/cpuinfo's words, which describe
    # the host rather than the CPU the code runs on under emulation.
    target = target_macros(compiler, _arch(variant)).encode()
    machine = [torch.__version__.encode(), os.uname().machine.encode(), cpu_identity().encode(), target]
    key = hashlib.sha256(b"\0".join([*code, recipe, *machine]))
    return cache_dir() / f"{library.name}-{key.hexdigest()[:16]}.so"


def build_library(library: Sources, compiler: str, variant: Variant = THREADED) -> Path:
    """Compile (or find already compiled) ``library``; raises on a failed build."""
    target = library_path(library, compiler, variant)
    if trusted_cache.take(target):  # a private cache directory, and the bytes this build sealed
        _touch(target)
        return target
    # Into a temporary name, then renamed: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = _command(library, compiler, variant, tmp)
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        # A shared library links with symbols missing (clang's OpenMP calls against libgomp): load it
        # once to know. In a child: a library this process mapped must never become the cached file,
        # since the cache's file is later replaced or (by a tamperer) rewritten in place, and a
        # rewrite in place reaches a mapping's relocated pages too, so the exit handlers ran garbage
        # (the SIGSEGV at interpreter exit after the trusted-cache test).
        check = [sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", tmp]
        loaded = subprocess.run(check, capture_output=True, text=True, timeout=60)
        if loaded.returncode != 0:
            reason = loaded.stderr.strip().splitlines()[-1:] or [f"exit {loaded.returncode}"]
            raise RuntimeError(f"{' '.join(command)} built a library that does not load: {reason[0]}")
        os.replace(tmp, target)
        trusted_cache.seal(target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    remove_stale(target.parent)
    return target


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache: the library still loads, it only ages
        pass


def remove_stale(directory: Path, now: float | None = None) -> list[Path]:
    """Deletes libraries unused for ``STALE_AFTER_S``, and temporary files a crashed build left behind
    (an hour old: no build takes that long); returns what it deleted."""
    now = time.time() if now is None else now
    removed = []
    # Every library here is one of ours (cpu_decode-*: the kernels' name before they held the linear too).
    for path in directory.glob("*.so"):
        max_age = 3600 if path.name.startswith("tmp") else STALE_AFTER_S
        try:
            if now - path.stat().st_mtime > max_age:
                path.unlink()
                removed.append(path)
        except OSError:  # gone already (another process cleaning), or not ours to delete
            continue
    return removed
