"""The 16-bit weight kernels (kernels/cpu/half.c) through ctypes: ``x @ W^T`` straight from rows of GGUF
F16 or BF16 values, and their float32 panel for the prefill path.

A library of its own beside the quantized one (kernels/cpu/quant.py), built the same way (compiler
flags, OpenMP runtime, cache directory), with the same call signatures: ``QuantLinear``
(engine/quant/linear.py) and the fused decode step (kernels/cpu/decode_step.c) take either. ``load()``
builds the machine's best code path (vdpbf16ps where the CPU has AVX512-BF16), ``load(scalar=True)`` the
plain-C one and ``load(level=...)`` one of ``LEVELS`` below the machine's, which the tests compare
against the same float64 references.
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
    name="cpu_half",
    sources=(Path(__file__).with_name("half.c"),),
    headers=(Path(__file__).with_name("half_tiles.h"),),
)
# half_tiles.h's tags, after quant.c's 0-7 so a fused step's Projection names its format unambiguously.
# BF16_ONCE (activations rounded to bf16 once, llama.cpp's way) is only measured: no weight holds it.
TYPE_IDS = {"BF16": 8, "F16": 9}
BF16_ONCE = 10
_PATHS = {3: "AVX-512 BF16 (vdpbf16ps)", 2: "AVX-512F", 1: "AVX2+F16C", 0: "plain C"}
_SIZE, _PTR = ctypes.c_int64, ctypes.c_void_p

# Instruction levels built besides the machine's own, and the macros the native build must have to run
# them (as kernels/cpu/quant.py's LEVELS): an AVX-512 BF16 machine runs all three code paths.
LEVELS = {"native": (), "x86-64-v4": ("-march=x86-64-v4",), "x86-64-v3": ("-march=x86-64-v3",)}
_LEVEL_NEEDS = {
    "native": (),
    "x86-64-v4": ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__"),
    "x86-64-v3": ("__AVX2__", "__FMA__", "__F16C__"),
}


def levels_here() -> tuple[str, ...]:
    """The levels of ``LEVELS`` this CPU runs (native always)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    features = native_features(compiler) if compiler else frozenset()
    return tuple(level for level, needs in _LEVEL_NEEDS.items() if set(needs) <= features)


class HalfLibrary:
    """``linear(type, x, rows)`` and ``dequantize(type, rows, start, count)`` over F16/BF16 weight rows:
    kernels/cpu/quant.py's ``QuantLibrary`` interface."""

    def __init__(self, path: Path):
        self.name = path.name
        self._lib = ctypes.CDLL(str(path))
        self.path = int(self._lib.pdserve_half_path())
        self._scratch_bytes = self._lib.pdserve_half_scratch_bytes
        self._scratch_bytes.argtypes = [_SIZE, _SIZE]
        self._scratch_bytes.restype = _SIZE
        self._linear = self._lib.pdserve_half_linear_into
        self._linear.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _PTR, _SIZE, _SIZE, _PTR, _PTR, _SIZE, _PTR]
        self._linear.argtypes += [ctypes.c_int]
        self._linear.restype = None
        self._team = self._lib.pdserve_half_linear_team_into  # for C callers only: its address
        self._dequantize = self._lib.pdserve_half_dequantize
        self._dequantize.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _SIZE, _SIZE, _PTR, ctypes.c_int]
        self._dequantize.restype = None

    @property
    def instructions(self) -> str:
        """Which of half_tiles.h's code paths this build took, for the start log."""
        return _PATHS[self.path]

    def linear(
        self,
        type_name: str | int,
        x: torch.Tensor,
        rows: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [m, in] float32 @ W^T (+ bias)`` for W held as ``rows`` ([out, 2 in] uint8), into ``out`` ([m, out],
        its rows may be apart) or a new tensor. ``type_name``: a key of TYPE_IDS, or BF16_ONCE."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == in_features
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        assert rows.shape[1] == 2 * in_features, (rows.shape, in_features)
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == rows.shape[:1])
        x = x.contiguous()
        m, out_features = x.shape[0], rows.shape[0]
        y = torch.empty((m, out_features), dtype=torch.float32) if out is None else out
        assert y.dtype == torch.float32 and y.shape == (m, out_features) and (m < 2 or y.stride(1) == 1), y.stride()
        scratch = torch.empty(self.scratch_bytes(m, in_features), dtype=torch.uint8)
        tag = type_name if isinstance(type_name, int) else TYPE_IDS[type_name]
        ldy = y.stride(0) if m > 1 else out_features
        self._linear(
            tag, x.data_ptr(), m, in_features, rows.data_ptr(), out_features, rows.shape[1],
            None if bias is None else bias.data_ptr(), y.data_ptr(), ldy, scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    @property
    def linear_address(self) -> int:
        """The address of ``pdserve_half_linear_into``, for C callers (kernels/cpu/decode_step.c's fused step)."""
        return ctypes.cast(self._linear, ctypes.c_void_p).value

    @property
    def team_address(self) -> int:
        """The address of ``pdserve_half_linear_team_into`` (kernels/cpu/decode_step_team.c)."""
        return ctypes.cast(self._team, ctypes.c_void_p).value

    def scratch_bytes(self, rows: int, in_features: int) -> int:
        """Bytes of work space one ``linear`` of ``rows`` rows of ``in_features`` values takes."""
        return int(self._scratch_bytes(rows, in_features))

    def dequantize(
        self, type_name: str, rows: torch.Tensor, in_features: int, start: int = 0, count: int | None = None
    ) -> torch.Tensor:
        """Rows ``[start, start + count)`` of W as float32 ``[count, in]`` (exact: every 16-bit value is a float32)."""
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        count = rows.shape[0] - start if count is None else count
        assert start >= 0 and start + count <= rows.shape[0]
        out = torch.empty((count, in_features), dtype=torch.float32)
        self._dequantize(
            TYPE_IDS[type_name], rows.data_ptr(), start, count, in_features, rows.shape[1], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


@functools.cache
def load(scalar: bool = False, level: str = "native") -> HalfLibrary | None:
    """The kernels, built if need be; None (logged once) where no compiler builds them here."""
    if level not in LEVELS:
        raise ValueError(f"instruction level {level!r} is not one of {sorted(LEVELS)}")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (CC=%s): F16/BF16 weights widened to float32 at load", os.environ.get("CC", "cc"))
        return None
    variant = Variant(defines=("PDSERVE_HALF_SCALAR",) if scalar else (), arch=LEVELS[level])
    try:
        library = HalfLibrary(build_library(SOURCES, compiler, variant))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("16-bit weight C kernels unavailable, F16/BF16 weights are widened to float32 at load: %s", e)
        return None
    log.info("16-bit weight C kernels: %s, %s code path", library.name, library.instructions)
    return library
