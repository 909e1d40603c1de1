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

import functools
import os
import shutil
from pathlib import Path

import torch

from kernels.cpu.build import Sources, Variant, native_features
from kernels.cpu.row_library import RowKernelLibrary, load_built

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


class HalfLibrary(RowKernelLibrary):
    """``linear(type, x, rows)`` and ``dequantize(type, rows, start, count)`` over F16/BF16 weight rows
    (``linear`` also takes BF16_ONCE as its type: measured only); dequantizing is exact, every 16-bit value
    being a float32."""

    def __init__(self, path: Path):
        super().__init__(path, "half", TYPE_IDS)
        self.path = int(self.symbol("path")())

    @property
    def instructions(self) -> str:
        """Which of half_tiles.h's code paths this build took, for the start log."""
        return _PATHS[self.path]

    def check_rows(self, rows: torch.Tensor, in_features: int) -> None:
        assert rows.shape[1] == 2 * in_features, (rows.shape, in_features)


@functools.cache
def load(scalar: bool = False, level: str = "native") -> HalfLibrary | None:
    """The kernels, built if need be; None (logged once) where no compiler builds them here."""
    if level not in LEVELS:
        raise ValueError(f"instruction level {level!r} is not one of {sorted(LEVELS)}")
    variant = Variant(defines=("PDSERVE_HALF_SCALAR",) if scalar else (), arch=LEVELS[level])
    return load_built(
        SOURCES, variant, HalfLibrary, "16-bit weight C kernels", "F16/BF16 weights are widened to float32 at load"
    )
