"""The quantized-weight CPU kernels (kernels/cpu/quant.c) through ctypes: ``x @ W^T`` straight from rows of
GGUF blocks or per-channel int8, and the dequantization of a panel of rows for the prefill path.

Built apart from the f32 kernels' library (kernels/cpu/native.py), with the same compiler flags, OpenMP
runtime and cache directory, so neither build waits on or invalidates the other. ``load()`` builds the
machine's best variant (VNNI where the CPU has it); ``load(scalar=True)`` the plain-C one, and
``load(level="x86-64-v3")`` one for a named instruction level below the machine's (``LEVELS``), which
the tests compare against the same references and the benchmark (benchmarks/engine/quant_linear.py)
times beside the native build.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kernels.cpu.build import Sources, Variant, build_library, native_features

log = logging.getLogger(__name__)

SOURCES = Sources(
    name="cpu_quant",
    sources=tuple(Path(__file__).with_name(name) for name in ("quant.c", "quant_tile512.c", "quant_panel16.c")),
    headers=tuple(Path(__file__).with_name(name) for name in ("quant_formats.h", "quant_avx2.h")),
)
TYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "I8": 5, "Q5_0": 6, "Q5_1": 7}  # quant_formats.h
_SIZE, _PTR = ctypes.c_int64, ctypes.c_void_p


# Instruction levels built besides the machine's own, by their compiler flags: an AVX-512 machine runs
# the code paths of older x86 CPUs (it has their instructions), so one machine tests them all.
LEVELS = {
    "native": (),  # -march=native: AVX-512 VNNI tiles, AVX-VNNI or AVX2, whatever the CPU has
    "x86-64-v3": ("-march=x86-64-v3",),  # AVX2, FMA, F16C, no VNNI: quant_avx2.h (Zen 2/3, Skylake)
    "avx-vnni": ("-march=x86-64-v3", "-mavxvnni"),  # 256-bit vpdpbusd, no AVX-512 (Alder Lake)
}

# The macros a level's build needs the native build to have (its -march promises more, all of which such
# CPUs have): the compiler's reading of the CPU, as for the build itself (build.native_features).
_LEVEL_NEEDS = {
    "native": (),
    "x86-64-v3": ("__AVX2__", "__FMA__", "__F16C__"),
    "avx-vnni": ("__AVX2__", "__FMA__", "__F16C__", "__AVXVNNI__"),
}


def levels_here() -> tuple[str, ...]:
    """The instruction levels of ``LEVELS`` this CPU runs (native always; only it where no compiler works)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    features = native_features(compiler) if compiler else frozenset()
    return tuple(level for level, needs in _LEVEL_NEEDS.items() if set(needs) <= features)


def _build(compiler: str, scalar: bool, level: str) -> Path:
    variant = Variant(defines=("PDSERVE_QUANT_SCALAR",) if scalar else (), arch=LEVELS[level])
    return build_library(SOURCES, compiler, variant)


class QuantLibrary:
    """``linear(type, x, rows)`` and ``dequantize(type, rows, start, count)`` over quantized weight rows."""

    def __init__(self, path: Path):
        self.name = path.name
        self._lib = ctypes.CDLL(str(path))
        self.vnni = bool(self._lib.pdserve_quant_vnni())
        self.avx2 = bool(self._lib.pdserve_quant_avx2())  # AVX2 without VNNI: kernels/cpu/quant_avx2.h
        self.tiles512 = bool(self._lib.pdserve_quant_tiles512())  # kernels/cpu/quant_tile512.c
        self._scratch_bytes = self._lib.pdserve_quant_scratch_bytes
        self._scratch_bytes.argtypes = [_SIZE, _SIZE]
        self._scratch_bytes.restype = _SIZE
        # y's rows ldy floats apart: a column range of a wider output (engine/quant/parts.py)
        self._linear = self._lib.pdserve_quant_linear_into
        self._linear.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _PTR, _SIZE, _SIZE, _PTR, _PTR]
        self._linear.argtypes += [_SIZE, _PTR, ctypes.c_int]  # ldy, scratch, threads
        self._linear.restype = None
        self._team = self._lib.pdserve_quant_linear_team_into  # for C callers only: its address
        self._dequantize = self._lib.pdserve_quant_dequantize
        self._dequantize.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _SIZE, _SIZE, _PTR, ctypes.c_int]
        self._dequantize.restype = None

    @property
    def instructions(self) -> str:
        """Which of quant.c's code paths this build took, for the start log and scripts/cpu-emulation-check."""
        if self.tiles512:
            return "AVX-512 VNNI"
        return "256-bit VNNI" if self.vnni else "AVX2" if self.avx2 else "plain C"

    def linear(
        self,
        type_name: str,
        x: torch.Tensor,
        rows: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [m, in] float32 @ W^T (+ bias)`` for W held as ``rows`` ([out, row_bytes] uint8), into ``out``
        ([m, out], its rows may be apart: a column range of a wider tensor) or a new tensor. Returns it."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == in_features and in_features % 32 == 0
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == rows.shape[:1])
        x = x.contiguous()
        m, out_features = x.shape[0], rows.shape[0]
        y = torch.empty((m, out_features), dtype=torch.float32) if out is None else out
        assert y.dtype == torch.float32 and y.shape == (m, out_features) and (m < 2 or y.stride(1) == 1), y.stride()
        scratch = torch.empty(self.scratch_bytes(m, in_features), dtype=torch.uint8)
        self._linear(
            TYPE_IDS[type_name],
            x.data_ptr(),
            m,
            in_features,
            rows.data_ptr(),
            out_features,
            rows.shape[1],
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            y.stride(0) if m > 1 else out_features,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        return y

    @property
    def linear_address(self) -> int:
        """The address of ``pdserve_quant_linear_into``, for C callers (kernels/cpu/decode_step.c's fused step)."""
        return ctypes.cast(self._linear, ctypes.c_void_p).value

    @property
    def team_address(self) -> int:
        """The address of ``pdserve_quant_linear_team_into``: ``linear`` for every thread of a caller's OpenMP
        region (kernels/cpu/decode_step_team.c)."""
        return ctypes.cast(self._team, ctypes.c_void_p).value

    def scratch_bytes(self, rows: int, in_features: int) -> int:
        """Bytes of work space one ``linear`` of ``rows`` rows of ``in_features`` values takes."""
        return int(self._scratch_bytes(rows, in_features))

    def dequantize(
        self, type_name: str, rows: torch.Tensor, in_features: int, start: int = 0, count: int | None = None
    ) -> torch.Tensor:
        """Rows ``[start, start + count)`` of W as float32 ``[count, in]``."""
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        count = rows.shape[0] - start if count is None else count
        assert start >= 0 and start + count <= rows.shape[0]
        out = torch.empty((count, in_features), dtype=torch.float32)
        self._dequantize(
            TYPE_IDS[type_name],
            rows.data_ptr(),
            start,
            count,
            in_features,
            rows.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


@functools.cache
def load(scalar: bool = False, level: str = "native") -> QuantLibrary | None:
    """The kernels, built if need be; None (logged once) where no compiler builds them here. ``level``: a
    key of ``LEVELS``; a build above this CPU's instructions loads but dies of SIGILL when called."""
    if level not in LEVELS:
        raise ValueError(f"instruction level {level!r} is not one of {sorted(LEVELS)}")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (CC=%s): quantized weights are dequantized at load", os.environ.get("CC", "cc"))
        return None
    try:
        library = QuantLibrary(_build(compiler, scalar, level))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("quantized C kernels unavailable, quantized weights are dequantized at load: %s", e)
        return None
    log.info("quantized C kernels: %s, %s code path", library.name, library.instructions)
    return library
