"""Decode attention over 8-bit KV pools on a GPU (issue #45), run by ``python -m benchmarks.gpu.kernels``.

One decode case's bfloat16 pool, and the same values as int8 rows (with their float16 scales) and as
e4m3: each pool's time with the Triton decode kernel, the bytes it reads per second against the
device's copy bandwidth, and its time against bfloat16's. Decode is bound by reading K and V, so an
8-bit pool should take about its share of bfloat16's bytes (fp8 0.5x, int8 0.5625x at head_dim 128)
plus what the dequantization costs in registers; the figure says how much that is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

POOLS = ("bfloat16", "fp8", "int8")


def eight_bit_pools(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from kernels.triton import kv_int8

    return {
        "bfloat16": (k_cache, v_cache),
        "fp8": (k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)),
        "int8": (kv_int8.quantize_rows(k_cache), kv_int8.quantize_rows(v_cache)),
    }


def bench_decode_kv_dtypes(inputs: tuple, time_ms: Callable, copy_gbps: float) -> dict:
    """``inputs``: a bfloat16 decode case (benchmarks.gpu.kernels.paged_inputs); ``time_ms``: its timer."""
    from kernels.triton.paged_decode import paged_decode_triton

    q, k_cache, v_cache, block_tables, context_lens, _, scale = inputs
    tokens = int(context_lens.sum())
    rows = {}
    for name, (k, v) in eight_bit_pools(k_cache, v_cache).items():
        ms = time_ms(lambda k=k, v=v: paged_decode_triton(q, k, v, block_tables, context_lens, scale), rep_ms=50)
        kv_bytes = 2 * tokens * k.shape[2] * k.shape[3] * k.element_size()  # rows with their scales
        rows[name] = {"ms": ms, "kv_bytes": kv_bytes, "of_copy": kv_bytes / ms / 1e6 / copy_gbps}
    base = rows["bfloat16"]
    print(f"\ndecode over 8-bit pools: batch {q.shape[0]}, {tokens} tokens of context")
    print(f"{'pool':<12}{'time ms':>10}{'MB read':>10}{'of copy':>10}{'time vs bf16':>14}{'bytes vs bf16':>15}")
    for name, row in rows.items():
        row["time_vs_bf16"] = row["ms"] / base["ms"]
        row["bytes_vs_bf16"] = row["kv_bytes"] / base["kv_bytes"]
        print(
            f"{name:<12}{row['ms']:>10.3f}{row['kv_bytes'] / 1e6:>10.0f}{row['of_copy']:>10.1%}"
            f"{row['time_vs_bf16']:>14.2f}{row['bytes_vs_bf16']:>15.4f}"
        )
    return rows
