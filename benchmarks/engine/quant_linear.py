"""The quantized linears (kernels/cpu/quant.c) against the f32 C linear (kernels/cpu/linear.c) on the same
shapes, measured side by side in one run: ``python -m benchmarks.engine.quant_linear``.

Shapes: SmolLM2-135M's projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, the tied
LM head 576->49152) and a 4096-wide layer (4096->4096). K-quants (256-value blocks) only where ``in`` is a
multiple of 256: llama-quantize gives SmolLM2's 576-wide rows another type too. Rows 1/4/16/64.
``Q5_0+Q8_0`` (qkv only): SmolLM2's Q4_K_M qkv in 14 of its 30 layers, q/k in Q5_0 and v (its last 192
rows) in Q8_0, as engine/quant/parts.py runs it (a kernel call per format into its columns), where the
float32 forward ran it before: its ``vs_f32`` is that change.

As in a decode step, each timed pass goes over ``copies`` copies of the weight (SmolLM2's 30 layers; one
for the LM head and the 4096 layer), so the weights come from memory, not a warm cache. The f32 and each
format are alternated within each repeat (best of ``repeats``), so load from other processes on a shared
machine falls on all alike, in a new random order each repeat, so that no system always follows the same
one. Printed per shape, rows and format: ms per weight, GB/s of weight bytes streamed, and ``vs_f32`` =
f32 time / quantized time (> 1: faster than f32).

``--builds native x86-64-v3 scalar`` times other builds of the same kernels beside the machine's own
(kernels/cpu/quant.py's ``LEVELS``: the AVX2 path of CPUs without VNNI, the plain-C one), alternated
too: ``Q8_0[x86-64-v3]`` with ``vs_native`` = the native build's time / this build's; ``int16`` the
native build rounding activations to two int8 terms (``model.quant_activations: int16``).

``--base REV [REV ...]`` times the native build of the kernels as they were at each git revision beside
this tree's, alternated the same way: ``Q8_0[REV]`` with ``tree_vs_base_time`` = this tree's time / that
revision's (below 1: this tree is the faster), for a change to the kernels that must not slow them.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.decode_vs_revision import sources_at
from kernels.cpu import native as cpu_native
from kernels.cpu import quant as cpu_quant
from kernels.cpu.build import Sources, build_library, cpu_identity

SHAPES = {  # name: (in, out, copies)
    "qkv": (576, 960, 30),
    "o": (576, 576, 30),
    "gate_up": (576, 3072, 30),
    "down": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
    "wide": (4096, 4096, 2),
}
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "I8", "Q5_0+Q8_0")
SPLIT, SPLIT_TAIL = "Q5_0+Q8_0", 192  # SmolLM2's v rows (3 KV heads of 64) in the second format
ROWS = (1, 4, 16, 64)


def _pass_seconds(run, copies) -> float:
    start = time.perf_counter()
    for weight in copies:
        run(weight)
    return (time.perf_counter() - start) / len(copies)


def _rows(type_name: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A random weight quantized to ``type_name``: llama.cpp's Python quantizer (gguf) where it has one,
    else engine/quant's."""
    import numpy as np
    from gguf import GGMLQuantizationType, quantize

    from engine.quant.int8 import quantize_int8
    from engine.quant.kquants import quantize_q4_k, quantize_q6_k

    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    made = {"I8": quantize_int8, "Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(type_name)
    if made is not None:
        return made(weight).rows
    return torch.from_numpy(np.ascontiguousarray(quantize(weight.numpy(), GGMLQuantizationType[type_name])))


def _weight(type_name: str, out_features: int, in_features: int, seed: int) -> list[torch.Tensor]:
    """The weight's rows per format run: one, or SPLIT's two."""
    if type_name != SPLIT:
        return [_rows(type_name, out_features, in_features, seed)]
    head, tail = type_name.split("+")
    return [_rows(head, out_features - SPLIT_TAIL, in_features, seed), _rows(tail, SPLIT_TAIL, in_features, seed)]


def _linear(lib, type_name: str, x: torch.Tensor, weight: list[torch.Tensor], in_features: int) -> torch.Tensor:
    if type_name != SPLIT:
        return lib.linear(type_name, x, weight[0], in_features)
    y = torch.empty(x.shape[0], sum(part.shape[0] for part in weight))
    first = weight[0].shape[0]
    for part_type, part, cols in zip(type_name.split("+"), weight, (y[:, :first], y[:, first:])):
        lib.linear(part_type, x, part, in_features, out=cols)
    return y


def library_at(revision: str) -> cpu_quant.QuantLibrary:
    """The quantized kernels (quant.py's SOURCES) from ``revision``'s kernels/cpu files, built natively as
    the engine builds them."""
    compiler = shutil.which("cc")
    assert compiler is not None, "a C compiler builds the kernels"
    with tempfile.TemporaryDirectory() as tmp:
        directory = sources_at(revision, Path(tmp))
        sources = Sources(
            name=cpu_quant.SOURCES.name,
            sources=tuple(directory / p.name for p in cpu_quant.SOURCES.sources if (directory / p.name).exists()),
            headers=tuple(sorted(directory.glob("*.h"))),
        )
        return cpu_quant.QuantLibrary(build_library(sources, compiler))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    # "int16": the native build with two activation terms (model.quant_activations int16)
    parser.add_argument("--builds", nargs="+", default=["native"], choices=[*cpu_quant.LEVELS, "scalar", "int16"])
    parser.add_argument(
        "--base", nargs="+", default=[], help="git revisions whose kernels are timed beside this tree's"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = cpu_native.load()
    how = {"scalar": {"scalar": True}, "int16": {"activations": "int16"}}
    libs = {b: cpu_quant.load(**how.get(b, {"level": b})) for b in args.builds}
    assert native is not None and None not in libs.values(), "the C kernels do not build here"
    runnable = set(cpu_quant.levels_here()) | {"scalar", "int16"}
    assert set(args.builds) <= runnable, f"this CPU runs only {sorted(runnable)}"
    bases = set(args.base)
    assert not bases & set(libs), f"a revision named as a build: {sorted(bases & set(libs))}"
    libs |= {revision: library_at(revision) for revision in args.base}
    print(f"# cpu: {cpu_identity()[:80]}... threads {args.threads}, builds {list(libs)}, base {args.base}")
    for name in args.shapes:
        in_features, out_features, copies = SHAPES[name]
        f32 = [native.pack_linear(torch.randn(out_features, in_features)) for _ in range(copies)]
        formats = [f for f in args.formats if not (f.endswith("_K") and in_features % 256)]
        formats = [f for f in formats if f != SPLIT or name == "qkv"]
        weights = {f: [_weight(f, out_features, in_features, i) for i in range(copies)] for f in formats}
        keys = {f if b == "native" else f"{f}[{b}]": (f, b) for f in formats for b in libs}
        shuffle = torch.Generator().manual_seed(0)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            best = dict.fromkeys(["f32", *keys], float("inf"))
            for attempt in range(args.repeats + 1):  # the first: warm-up
                runs = {"f32": (lambda w: native.linear(x, w), f32)}
                for key, (f, b) in keys.items():
                    runs[key] = (lambda w, f=f, lib=libs[b]: _linear(lib, f, x, w, in_features), weights[f])
                # a new order each repeat: the pass right after f32's ran up to 1.5x slower (the same
                # library built twice, timed side by side), which a fixed order, or a rotation of it,
                # charged to the same system every time; the best of the repeats drops it
                for i in torch.randperm(len(runs), generator=shuffle).tolist():
                    key = list(runs)[i]
                    run, ws = runs[key]
                    seconds = _pass_seconds(run, ws)
                    if attempt:
                        best[key] = min(best[key], seconds)
            f32_bytes = out_features * in_features * 4
            line = [f"{name} {in_features}->{out_features} rows={rows}: f32 {best['f32'] * 1e3:.3f}ms"]
            line[0] += f" {f32_bytes / best['f32'] / 1e9:.1f}GB/s"
            for key, (f, b) in keys.items():
                gbs = sum(part.numel() for part in weights[f][0]) / best[key] / 1e9
                line.append(f"{key} {best[key] * 1e3:.3f}ms {gbs:.1f}GB/s vs_f32={best['f32'] / best[key]:.2f}")
                if b in bases and f in best:
                    line[-1] += f" tree_vs_base_time={best[f] / best[key]:.2f}"
                elif b != "native" and f in best:
                    line[-1] += f" vs_native={best[f] / best[key]:.2f}"
            print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
