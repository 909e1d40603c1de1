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

import functools
import os
import shutil
from pathlib import Path

import torch

from kernels.cpu.build import Sources, Variant, native_features
from kernels.cpu.row_library import RowKernelLibrary, load_built

SOURCES = Sources(
    name="cpu_quant",
    sources=tuple(Path(__file__).with_name(name) for name in ("quant.c", "quant_tile512.c", "quant_panel16.c")),
    headers=tuple(Path(__file__).with_name(name) for name in ("quant_formats.h", "quant_avx2.h")),
    # quantize_row's residual x - d q is a product then a difference, each rounded, as in
    # engine/quant/act_blocks.py: GCC would otherwise fuse them into one FMA where the target has it
    flags=("-ffp-contract=off",),
)
TYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "I8": 5, "Q5_0": 6, "Q5_1": 7}  # quant_formats.h
TERMS_TAG = 16  # tag = format + TERMS_TAG * (terms - 1) (quant_formats.h)
# model.quant_activations: the int8 terms each row of x is rounded to. int8: one, llama.cpp's scheme (blocks of 16
# where it has 32); int16: two, the second what the first left, so x to 1/64516 of each block's max
ACTIVATIONS = {"int8": 1, "int16": 2}


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


class QuantLibrary(RowKernelLibrary):
    """``linear(type, x, rows)`` and ``dequantize(type, rows, start, count)`` over quantized weight rows."""

    def __init__(self, path: Path, activations: str = "int8"):
        self.act_terms = ACTIVATIONS[activations]
        super().__init__(path, "quant", {k: v + TERMS_TAG * (self.act_terms - 1) for k, v in TYPE_IDS.items()})
        if self.act_terms > 1:  # its own timings (engine/quant/forms.py keys them by the name)
            self.name += f"+{activations}"
        self.vnni = bool(self.symbol("vnni")())
        self.avx2 = bool(self.symbol("avx2")())  # AVX2 without VNNI: kernels/cpu/quant_avx2.h
        self.tiles512 = bool(self.symbol("tiles512")())  # kernels/cpu/quant_tile512.c

    @property
    def instructions(self) -> str:
        """Which of quant.c's code paths this build took, for the start log and scripts/cpu-emulation-check."""
        if self.tiles512:
            return "AVX-512 VNNI"
        return "256-bit VNNI" if self.vnni else "AVX2" if self.avx2 else "plain C"

    def check_rows(self, rows: torch.Tensor, in_features: int) -> None:
        assert in_features % 32 == 0, in_features  # whole blocks of 32 (of 256 for the K-quants: their row bytes)


@functools.cache
def load(scalar: bool = False, level: str = "native", activations: str = "int8") -> QuantLibrary | None:
    """The kernels, built if need be; None (logged once) where no compiler builds them here. ``level``: a
    key of ``LEVELS``; a build above this CPU's instructions loads but dies of SIGILL when called.
    ``activations``: a key of ``ACTIVATIONS``, how the returned object's calls round x (one build serves all)."""
    if level not in LEVELS:
        raise ValueError(f"instruction level {level!r} is not one of {sorted(LEVELS)}")
    variant = Variant(defines=("PDSERVE_QUANT_SCALAR",) if scalar else (), arch=LEVELS[level])
    return load_built(
        SOURCES,
        variant,
        lambda path: QuantLibrary(path, activations),
        "quantized C kernels",
        "quantized weights are dequantized at load",
    )
