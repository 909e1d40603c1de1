"""scripts/cpu-emulation-check's own parts that need no QEMU: it says what it lacks and exits 2, and its
disassembly check tells an AVX-512 library from an AVX2 one and a plain one. (The check itself runs
emulated CPUs: docs/engine.md, "CPUs without AVX-512".)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from benchmarks.emulation import check

# a loop GCC vectorizes at -O3 with whatever vector registers the flags allow
LOOP = "void axpy(float *y, const float *x, float a, int n) { for (int i = 0; i < n; i++) y[i] += a * x[i]; }\n"


def test_a_missing_qemu_is_named_with_how_to_install_it(tmp_path: Path, capsys) -> None:
    assert check.main(["--qemu", str(tmp_path / "qemu-x86_64"), "--models", "Haswell"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpu-emulation-check needs: ") and "7.2 or later (apt-get install qemu-user)" in err


def _library(tmp_path: Path, name: str, *flags: str) -> Path:
    source, out = tmp_path / "axpy.c", tmp_path / f"{name}.so"
    source.write_text(LOOP)
    cc = shutil.which("cc")
    subprocess.run([cc, "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(out)], check=True)
    return out


def test_the_disassembly_tells_the_vector_widths_apart(tmp_path: Path) -> None:
    avx512 = check._registers(_library(tmp_path, "avx512", "-march=x86-64-v4", "-mprefer-vector-width=512"))
    avx2 = check._registers(_library(tmp_path, "avx2", "-march=x86-64-v3"))
    sse = check._registers(_library(tmp_path, "sse", "-march=x86-64-v2"))
    assert avx512["zmm"] > 0
    assert avx2["zmm"] == 0 and avx2["ymm"] > 0
    assert sse == {"zmm": 0, "ymm": 0}
