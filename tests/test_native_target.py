"""Which instructions a ``-march=native`` build may use is the compiler's reading of the CPU (cpuid and the
OS's saved state), and the kernel cache's key and the instruction levels the tests build follow it, not
/proc/cpuinfo's words. Under user-mode emulation (``qemu-x86_64 -cpu Haswell``, scripts/cpu-emulation-check)
/proc/cpuinfo describes the host: an AVX-512 host's text let a Haswell process load the host's AVX-512
library from a shared cache, and listed the AVX-VNNI level as runnable there (SIGILL in its tests).

The compilers here are shell scripts that answer ``-dM -E`` as GCC does, for a CPU the test names."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from kernels.cpu import build, quant

HASWELL = ("__GNUC__ 12", "__AVX__ 1", "__AVX2__ 1", "__FMA__ 1", "__F16C__ 1", "__haswell__ 1")
ZEN5 = (*HASWELL[:-1], "__AVX512F__ 1", "__AVX512VNNI__ 1", "__AVXVNNI__ 1", "__znver3__ 1")
NEHALEM = ("__GNUC__ 12", "__SSE4_2__ 1", "__nehalem__ 1")
# /proc/cpuinfo as an AVX-512 host shows it, to every process there, emulated ones included
HOST_CPUINFO = json.dumps({"flags": "sse4_2 avx avx2 fma f16c avx512f avx512_vnni avx_vnni", "model name": "EPYC"})


@pytest.fixture(autouse=True)
def _fresh_compiler_answers():
    build.target_macros.cache_clear()
    yield
    build.target_macros.cache_clear()


def _compiler(path: Path, macros: tuple[str, ...]) -> str:
    """A compiler at ``path`` that predefines ``macros`` for any flags (rewritten in place: the same path)."""
    lines = "".join(f"#define {m}\\n" for m in macros)
    path.write_text(f'#!/bin/sh\ncase "$*" in *-dM*) printf "{lines}" ;; *) exit 1 ;; esac\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_cache_key_follows_the_compilers_reading_of_the_cpu(tmp_path, monkeypatch):
    """One compiler path, one /proc/cpuinfo, one cache directory: the native build for an AVX-512 CPU and
    the one for a Haswell are different files."""
    monkeypatch.setattr(build, "cpu_identity", lambda: HOST_CPUINFO)
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path / "cache"))
    cc = _compiler(tmp_path / "cc", ZEN5)
    on_host = build.library_path(quant.SOURCES, cc, build.THREADED)
    _compiler(tmp_path / "cc", HASWELL)
    build.target_macros.cache_clear()
    on_haswell = build.library_path(quant.SOURCES, cc, build.THREADED)
    assert on_host != on_haswell
    assert on_host.parent == on_haswell.parent == tmp_path / "cache"


@pytest.mark.parametrize(
    "macros,levels",
    [(ZEN5, ("native", "x86-64-v3", "avx-vnni")), (HASWELL, ("native", "x86-64-v3")), (NEHALEM, ("native",))],
)
def test_levels_here_are_the_compilers_not_proc_cpuinfos(tmp_path, monkeypatch, macros, levels):
    monkeypatch.setattr(build, "cpu_identity", lambda: HOST_CPUINFO)
    monkeypatch.setenv("CC", _compiler(tmp_path / "cc", macros))
    assert quant.levels_here() == levels


def test_a_compiler_that_fails_leaves_native_only(tmp_path, monkeypatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert build.target_macros(str(broken), ("-march=native",)) == ""
    assert quant.levels_here() == ("native",)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert quant.levels_here() == ("native",)


def test_this_machines_compiler_agrees_with_proc_cpuinfo():
    """Natively the two readings agree on the features the kernels' code paths choose by."""
    flags = set(json.loads(build.cpu_identity()).get("flags", "").split())
    features = build.native_features(shutil.which("cc"))
    for flag, macro in (("avx2", "__AVX2__"), ("fma", "__FMA__"), ("f16c", "__F16C__"), ("avx512f", "__AVX512F__")):
        assert (flag in flags) == (macro in features), flag
