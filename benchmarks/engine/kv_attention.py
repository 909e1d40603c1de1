"""The int8 KV kernels against the float32 ones, alone, in one process, alternated round by round:

    python -m benchmarks.engine.kv_attention [--threads 1] [--streams 32] [--context 384] [--rounds 5]

SmolLM2-135M's attention shape (9 query heads on 3 KV heads of 64, blocks of 16, 30 layers). Decode:
``--streams`` sequences of ``--context`` tokens, one query each, over every layer's own K/V (random
values, blocks in random places), so rows come from memory as in a decode step, not from a cache
warmed by the layer before; the figure is ms per layer. Prefill: one prompt of ``--prompt`` tokens,
the attention (prefill.c) and the RoPE + K/V store (layer_ops.c / kv_int8_ops.c) of one layer.
Printed::

    decode f32_ms=<a> int8_ms=<b> int8_vs_f32_time=<b / a>
    prefill_attention f32_ms=.. int8_ms=.. int8_vs_f32_time=..
    rope_store f32_ms=.. int8_ms=.. int8_vs_f32_time=..

Below 1.0 the int8 kernel is the faster. The engine-level and served figures: kv_decode.py and
``python -m benchmarks.serve --systems disagg,disagg-int8``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels.cpu import native
from kernels.cpu.kv_int8 import int8_kernels
from kernels.triton import kv_int8

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def best_ms(runs: dict[str, Callable[[], None]], rounds: int, repeat: int) -> dict[str, float]:
    """Best of ``rounds`` for each, the systems alternated so that all see the same load."""
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm-up: the first call pays for the threads' start and the pages' first touch
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(repeat):
                run()
            best[name] = min(best[name], (time.perf_counter() - start) / repeat * 1e3)
    return best


def report(label: str, ms: dict[str, float]) -> None:
    print(f"{label} f32_ms={ms['f32']:.3f} int8_ms={ms['int8']:.3f} int8_vs_f32_time={ms['int8'] / ms['f32']:.3f}")


def pools(num_blocks: int, layers: int, g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: float32 K, V and their int8 rows."""
    out = []
    for _ in range(layers):
        k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        out.append((k, v, kv_int8.quantize_rows(k), kv_int8.quantize_rows(v)))
    return out


def decode(lib, args, g: torch.Generator) -> None:
    blocks = -(-args.context // BLOCK)
    layers = pools(args.streams * blocks + 1, LAYERS, g)
    tables = torch.randperm(args.streams * blocks, generator=g).view(args.streams, blocks).contiguous()
    lens = torch.full((args.streams,), args.context, dtype=torch.int64)
    q = torch.randn(args.streams, HEADS, HEAD_DIM, generator=g)
    i8 = int8_kernels(lib)

    def f32() -> None:
        for k, v, _, _ in layers:
            lib.paged_decode(q, k, v, tables, lens, args.context, HEAD_DIM**-0.5)

    def int8() -> None:
        for _, _, k, v in layers:
            i8.decode(q, k, v, tables, lens, args.context, HEAD_DIM**-0.5)

    ms = best_ms({"f32": f32, "int8": int8}, args.rounds, 1)
    report("decode", {name: t / LAYERS for name, t in ms.items()})


def prefill(lib, args, g: torch.Generator) -> None:
    tokens, blocks = args.prompt, -(-args.prompt // BLOCK)
    ((k, v, k8, v8),) = pools(blocks + 1, 1, g)
    tables = torch.randperm(blocks, generator=g).view(1, blocks).contiguous()
    lens, starts = torch.tensor([tokens]), torch.tensor([0, tokens])
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    i8 = int8_kernels(lib)
    attention = {
        "f32": lambda: lib.paged_prefill(q, k, v, tables, lens, starts, HEAD_DIM**-0.5),
        "int8": lambda: i8.prefill(q, k8, v8, tables, lens, starts, HEAD_DIM**-0.5),
    }
    report("prefill_attention", best_ms(attention, args.rounds, 5))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=g)
    cos, sin, slots = angles.cos(), angles.sin(), torch.randperm(tokens, generator=g)
    flat = [x.view(-1, KV_HEADS, x.shape[-1]) for x in (k, v, k8, v8)]
    store = {
        "f32": lambda: lib.rope_store(qkv, HEADS, KV_HEADS, cos, sin, slots, flat[0], flat[1]),
        "int8": lambda: i8.rope_store(qkv, HEADS, KV_HEADS, cos, sin, slots, flat[2], flat[3]),
    }
    report("rope_store", best_ms(store, args.rounds, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.load()
    assert lib is not None, "the C kernels must build here"
    print(f"{args.threads} thread(s); decode: {args.streams} x {args.context} tokens; prefill: {args.prompt} tokens")
    g = torch.Generator().manual_seed(0)
    decode(lib, args, g)
    prefill(lib, args, g)


if __name__ == "__main__":
    main()
