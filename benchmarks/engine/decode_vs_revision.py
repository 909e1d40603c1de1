"""The decode attention kernels of this tree (decode.c, decode_int8.c) against the same kernels at a git
revision, in one process, alternated round by round: for a change to them that must keep both their
output and their speed (a refactor, a shared loop):

    python -m benchmarks.engine.decode_vs_revision [--base 89a91b5] [--threads 1] [--streams 32]
        [--context 384] [--rounds 5]

kv_attention.py's decode shape: SmolLM2-135M's attention (9 query heads on 3 KV heads of 64, blocks of
16), ``--streams`` sequences of ``--context`` tokens over 30 layers' own K/V (random, blocks in random
places), float32 and int8 pools. Each library is the engine's (native.py's sources, built as build.py
builds them, cached), from the revision's kernels/cpu files or this tree's. Printed per pool::

    f32 base_ms=<a> tree_ms=<b> tree_vs_base_time=<b / a> identical=<True: the outputs agree bit for bit>

ms per layer, best of the rounds; below 1.0 this tree's kernel is the faster.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.engine.kv_attention import BLOCK, HEAD_DIM, HEADS, LAYERS, best_ms, pools
from kernels.cpu import native, paged_call
from kernels.cpu.build import Sources, build_library

KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
ENTRY_POINTS = {"f32": "pdserve_paged_decode_f32", "int8": "pdserve_paged_decode_i8"}


def sources_at(revision: str, into: Path) -> Path:
    """kernels/cpu's C files as they were at ``revision``, written into ``into``."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=KERNELS, capture_output=True, text=True)
    top = Path(root.stdout.strip())
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{revision}:kernels/cpu"], cwd=top, capture_output=True, text=True
    )
    if listed.returncode != 0:
        raise SystemExit(f"no kernels/cpu at {revision}: {listed.stderr.strip()}")
    for name in listed.stdout.split():
        if name.endswith((".c", ".h")):
            shown = subprocess.run(["git", "show", f"{revision}:kernels/cpu/{name}"], cwd=top, capture_output=True)
            (into / name).write_bytes(shown.stdout)
    return into


def kernels_library(directory: Path) -> ctypes.CDLL:
    """The engine's kernel library (native.SOURCES) from ``directory``'s files, built as the engine
    builds it (OpenMP): the same code, in the same places, as a server would run."""
    library = Sources(
        name=native.SOURCES.name,
        # a file this tree split out (prefill_tile.c) is absent at an older revision, whose own file holds it
        sources=tuple(directory / p.name for p in native.SOURCES.sources if (directory / p.name).exists()),
        headers=tuple(sorted(directory.glob("*.h"))),
    )
    compiler = shutil.which("cc")
    assert compiler is not None, "a C compiler builds the kernels"
    return ctypes.CDLL(str(build_library(library, compiler)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="89a91b5", help="the git revision to compare with")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of each kernel")
    parser.add_argument("--streams", type=int, default=32, help="sequences, one query token each")
    parser.add_argument("--context", type=int, default=384, help="tokens of context per sequence")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all layers per library: the best counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"base": kernels_library(sources_at(args.base, Path(tmp))), "tree": kernels_library(KERNELS)}
    g = torch.Generator().manual_seed(0)
    blocks = -(-args.context // BLOCK)
    layers = pools(args.streams * blocks + 1, LAYERS, g)
    tables = torch.randperm(args.streams * blocks, generator=g).view(args.streams, blocks).contiguous()
    lens = torch.full((args.streams,), args.context, dtype=torch.int64)
    q = torch.randn(args.streams, HEADS, HEAD_DIM, generator=g)
    print(f"base {args.base}; {args.threads} thread(s); {args.streams} x {args.context} tokens, {LAYERS} layers")
    for pool, symbol in ENTRY_POINTS.items():
        caches = [(k, v) if pool == "f32" else (k8, v8) for k, v, k8, v8 in layers]
        fns = {
            name: paged_call.bind(getattr(lib, symbol), paged_call.DECODE_ARGTYPES) for name, lib in libraries.items()
        }

        def run(fn, caches=caches) -> list[torch.Tensor]:
            return [paged_call.paged_decode(fn, q, k, v, tables, lens, args.context, HEAD_DIM**-0.5) for k, v in caches]

        identical = all(torch.equal(a, b) for a, b in zip(run(fns["base"]), run(fns["tree"]), strict=True))
        ms = best_ms({name: lambda fn=fn: run(fn) for name, fn in fns.items()}, args.rounds, 1)
        base, tree = ms["base"] / LAYERS, ms["tree"] / LAYERS
        print(f"{pool} base_ms={base:.3f} tree_ms={tree:.3f} tree_vs_base_time={tree / base:.3f} identical={identical}")


if __name__ == "__main__":
    main()
