"""llama.cpp's ``llama-server`` built from source, and the benchmark model converted to GGUF for it.

The source is the ``llama-cpp-python`` sdist from PyPI (it vendors llama.cpp under vendor/llama.cpp;
PyPI is reachable where GitHub may not be), pinned so every machine builds the same server. Everything
lands in a cache directory outside the repository, made once and reused:

    ~/.cache/pdserve/llama.cpp-<version>/
        llama_cpp_python-<version>/vendor/llama.cpp/      the source, unpacked from the sdist
            build/bin/llama-server                        built with -DGGML_NATIVE=ON (this CPU's ISA)
        <model dir name>-f32.gguf                         the converted benchmark model

A build takes ~10 minutes on 2 cores; the conversion ~15 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# the newest release that builds here (its vendored llama.cpp: build-info names the commit)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_JOBS = 2
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return Path.home() / ".cache" / "pdserve" / f"llama.cpp-{version}"


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_dir(version) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def server_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return source_dir(version) / "build" / "bin" / "llama-server"


def gguf_path(model_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_dir(version) / f"{model_dir.name}-f32.gguf"


def _run(argv: list[str], cwd: Path | None = None) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, cwd=cwd, check=True)


def fetch_source(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The vendored llama.cpp of the pinned sdist, downloaded and unpacked unless it already is."""
    if (source_dir(version) / "CMakeLists.txt").is_file():
        return source_dir(version)
    cache_dir(version).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", tmp]
            + [f"llama-cpp-python=={version}"]
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(cache_dir(version), filter="data")
    return source_dir(version)


def tool_binary(name: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``llama-quantize`` or ``llama-perplexity`` (benchmarks/peers/gguf_variants.py, engine/gguf_accuracy.py)."""
    return source_dir(version) / "build" / "bin" / name


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = BUILD_JOBS) -> Path:
    """``llama-server`` and the two tools the GGUF benchmarks use (no tests, examples or curl), Release,
    for this CPU; the server binary's path."""
    if all(tool_binary(t, version).is_file() for t in TARGETS):
        return server_binary(version)
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"building llama-server needs {missing}: apt-get install -y cmake g++")
    src = fetch_source(version)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(
        ["cmake", "-B", "build", *generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
        + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
        cwd=src,
    )
    _run(["cmake", "--build", "build", "--target", *TARGETS, f"-j{jobs}"], cwd=src)
    return server_binary(version)


def convert(model_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``model_dir`` as GGUF f32 (pdserve serves it in f32 on CPU), by the vendored converter."""
    out = gguf_path(model_dir, version)
    if out.is_file() and out.stat().st_mtime >= (model_dir / "model.safetensors").stat().st_mtime:
        return out
    src = fetch_source(version)
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")]))}
    argv = [
        sys.executable,
        "-m",
        "benchmarks.peers.gguf_convert",
        str(src),
        str(model_dir),
        str(partial),
        "--outtype",
        "f32",
    ]
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True, env=env)
    partial.replace(out)  # a conversion cut short never passes for a finished one
    return out


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
