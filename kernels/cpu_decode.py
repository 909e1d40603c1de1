"""The C decode-attention kernel for CPU (cpu_decode.c): built on first use, called through ctypes.

``load()`` compiles cpu_decode.c with the machine's C compiler (``$CC``, else ``cc``) for this very
CPU (``-march=native``) into ``~/.cache/pdserve/native/`` (``$PDSERVE_NATIVE_CACHE_DIR`` overrides),
once per source, compiler and torch: later processes load the cached library (a build takes ~1 s).
Where no compiler works, it logs why once and returns None, and the engine keeps the torch path.

It links the OpenMP runtime torch ships (``torch/lib/libgomp.so.1``) when there is one, so the kernel's
threads are torch's threads rather than a second pool competing for the same cores. ctypes releases
the GIL around the call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wno-psabi", "-shared", "-fPIC")
_SIZE = ctypes.c_int64
_PTR = ctypes.c_void_p


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_NATIVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve" / "native"


def _torch_libgomp() -> Path | None:
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return path if path.exists() else None


def _link_flags() -> list[str]:
    gomp = _torch_libgomp()
    if gomp is None:  # torch linked against the system's runtime (or none): let -fopenmp pick it
        return []
    return [f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}", "-lgomp"]


def build(compiler: str) -> Path:
    """Compile (or find already compiled) the library; raises on a failed build."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(_FLAGS + tuple(_link_flags())).encode(),
                                     torch.__version__.encode(), os.uname().machine.encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a temporary name, then renamed: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, str(SOURCE), "-o", tmp, *_link_flags()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class DecodeLibrary:
    """The loaded kernel: ``supports(group, head_dim)`` and ``paged_decode(...)``."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._supported = self._lib.pdserve_decode_supported
        self._supported.argtypes = [_SIZE, _SIZE]
        self._supported.restype = ctypes.c_int
        self._decode = self._lib.pdserve_paged_decode_f32
        self._decode.argtypes = [_PTR, _SIZE, _PTR, _PTR, _PTR, _SIZE, _PTR, _PTR, _PTR,
                                 _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, ctypes.c_float, ctypes.c_int]
        self._decode.restype = None

    def supports(self, group: int, head_dim: int) -> bool:
        return bool(self._supported(group, head_dim))

    def paged_decode(
        self,
        q: torch.Tensor,  # [batch, num_heads, head_dim] float32; rows may be strided, heads packed
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float32, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, max_blocks] int64, contiguous
        context_lens: torch.Tensor,  # [batch] int64, each >= 1
        max_context: int,  # >= every context length
        scale: float,
    ) -> torch.Tensor:  # [batch, num_heads, head_dim]
        batch, num_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        # The C code trusts these: a wrong layout would read the wrong memory, not raise.
        assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        assert q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.is_contiguous()
        assert context_lens.is_contiguous() and block_tables.shape[0] == batch == context_lens.shape[0]
        assert block_tables.shape[1] * block_size >= max_context  # supports() was checked once, at engine build
        ctx_pad = -(-max_context // 16) * 16
        out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
        scratch = torch.empty(batch * num_heads * ctx_pad, dtype=torch.float32)  # softmax rows
        self._decode(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                     block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                     batch, num_heads, kv_heads, head_dim, block_size, ctx_pad, scale, torch.get_num_threads())
        return out


@functools.cache
def load() -> DecodeLibrary | None:
    """The kernel, built if need be; None (logged once) where it cannot be built or loaded here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (CC=%s): CPU decode attention stays on the torch path", os.environ.get("CC", "cc"))
        return None
    try:
        return DecodeLibrary(build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("C decode kernel unavailable, CPU decode attention stays on the torch path: %s", e)
        return None
