"""Kernel benchmark: ``python -m benchmarks.kernels [--json FILE]`` (needs CUDA; exits 0 with a note without).

- Decode attention is memory bound: every step reads each request's whole K and V once. The figure
  of merit is the bandwidth the kernel achieves (K/V bytes read / time) as a fraction of what this
  device reaches on a plain large device-to-device copy (target >= 0.7), next to the torch reference.
- Prefill attention (causal, chunks over a paged cache) is compute bound: TFLOP/s of the Triton
  kernel against the torch reference (SDPA per request) on the same inputs.
- Block copy (gather a request's blocks into a send buffer, scatter them into a pool): bytes moved
  per second against torch's ``index_select`` / indexed assignment and the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 2048, 32, 8, 128, 16
PREFILL_LENS = [512, 1024, 2048, 300, 77, 1500, 128, 900]  # one step's chunks, each its own whole prompt
COPY_LAYERS, COPY_POOL_BLOCKS, COPY_BLOCKS = 32, 1024, 256  # a 32-layer pool; one transfer of 4096 tokens
DTYPE = torch.bfloat16
TARGET_DECODE_OF_COPY = 0.7


def time_ms(fn, warmup: int = 5, iters: int = 50) -> float:
    """Median of CUDA-event timings of ``fn`` (after warmup)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * num_bytes / ms / 1e6


def paged_inputs(q_lens: list[int], context_lens: list[int]):
    """Attention inputs over a shuffled paged cache: (q, k_cache, v_cache, block_tables, context_lens,
    query_start_loc, scale); q has sum(q_lens) rows, request i's rows are its last q_lens[i] positions."""
    blocks_per_seq = -(-max(context_lens) // BLOCK_SIZE)
    num_blocks = len(context_lens) * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    # Shuffled block ids: a real pool hands out blocks in no particular order.
    block_tables = torch.randperm(num_blocks, device="cuda").view(len(context_lens), blocks_per_seq).int()
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, block_tables, lens, query_start_loc, HEAD_DIM**-0.5


def bench_decode(batch: int, context: int, copy_gbps: float) -> dict:
    from kernels import paged_attention
    from kernels.paged_attention import paged_attention_reference
    from kernels.paged_decode import paged_decode_triton

    inputs = paged_inputs([1] * batch, [context] * batch)
    q, k_cache, v_cache, block_tables, context_lens, _, scale = inputs
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    ref_ms = time_ms(lambda: paged_attention_reference(*inputs), iters=10)
    rows = {"triton (auto splits)": time_ms(lambda: paged_attention(*inputs))}
    for splits in (1, 2, 4, 8):

        def run(s=splits):
            return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=s)

        rows[f"triton, {splits} split(s)"] = time_ms(run)
    rows["torch reference"] = ref_ms
    error = (paged_attention(*inputs).float() - paged_attention_reference(*inputs).float()).abs().max().item()
    print(
        f"decode: batch {batch} x context {context}, {HEADS} q / {KV_HEADS} kv heads, head dim {HEAD_DIM}, "
        f"block size {BLOCK_SIZE}, {DTYPE}; K/V read {kv_bytes / 1e6:.0f} MB"
    )
    print(f"{'variant':<24}{'time ms':>10}{'GB/s':>10}{'of copy':>10}{'vs torch':>10}")
    for name, ms in rows.items():
        gbps = kv_bytes / ms / 1e6
        print(f"{name:<24}{ms:>10.3f}{gbps:>10.0f}{gbps / copy_gbps:>10.1%}{ref_ms / ms:>9.1f}x")
    fraction = kv_bytes / rows["triton (auto splits)"] / 1e6 / copy_gbps
    print(
        f"max |triton - reference| = {error:.2e}; decode bandwidth {fraction:.2f} of copy "
        f"(target >= {TARGET_DECODE_OF_COPY}) {'MET' if fraction >= TARGET_DECODE_OF_COPY else 'NOT MET'}"
    )
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "ms": rows,
        "max_abs_error": error,
        "of_copy": fraction,
        "target_of_copy": TARGET_DECODE_OF_COPY,
        "met": fraction >= TARGET_DECODE_OF_COPY,
    }


def bench_prefill() -> dict:
    from kernels.paged_prefill import paged_prefill_reference, paged_prefill_triton

    inputs = paged_inputs(PREFILL_LENS, PREFILL_LENS)
    # Causal attention: QK^T and PV over the visible half, 2 FLOPs per multiply-add.
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in PREFILL_LENS)
    triton_ms = time_ms(lambda: paged_prefill_triton(*inputs), iters=20)
    ref_ms = time_ms(lambda: paged_prefill_reference(*inputs), iters=10)
    error = (paged_prefill_triton(*inputs).float() - paged_prefill_reference(*inputs).float()).abs().max().item()
    print(f"\nprefill: {len(PREFILL_LENS)} prompts of {PREFILL_LENS} tokens, {flops / 1e9:.1f} GFLOP causal")
    for name, ms in (("triton", triton_ms), ("torch reference (SDPA)", ref_ms)):
        print(f"{name:<24}{ms:>10.3f} ms{flops / ms / 1e9:>10.1f} TFLOP/s{ref_ms / ms:>9.1f}x")
    print(f"max |triton - reference| = {error:.2e}")
    return {
        "q_lens": PREFILL_LENS,
        "flops": flops,
        "ms": {"triton": triton_ms, "torch reference": ref_ms},
        "tflops": flops / triton_ms / 1e9,
        "vs_torch": ref_ms / triton_ms,
        "max_abs_error": error,
    }


def bench_block_copy(copy_gbps: float) -> dict:
    from kernels.block_copy import (
        gather_blocks_reference,
        gather_blocks_triton,
        scatter_blocks_reference,
        scatter_blocks_triton,
    )

    pool = torch.randn(COPY_LAYERS, 2, COPY_POOL_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    ids = torch.randperm(COPY_POOL_BLOCKS, device="cuda")[:COPY_BLOCKS]
    buffer = gather_blocks_triton(pool, ids)
    assert torch.equal(buffer, gather_blocks_reference(pool, ids))
    moved = 2 * buffer.numel() * buffer.element_size()  # read + written
    rows = {
        "gather triton": time_ms(lambda: gather_blocks_triton(pool, ids, out=buffer)),
        "gather torch": time_ms(lambda: gather_blocks_reference(pool, ids)),
        "scatter triton": time_ms(lambda: scatter_blocks_triton(pool, ids, buffer)),
        "scatter torch": time_ms(lambda: scatter_blocks_reference(pool, ids, buffer)),
    }
    print(
        f"\nblock copy: {COPY_BLOCKS} of {COPY_POOL_BLOCKS} blocks x {COPY_LAYERS} layers "
        f"({buffer.numel() * buffer.element_size() / 1e6:.0f} MB)"
    )
    for name, ms in rows.items():
        print(f"{name:<24}{ms:>10.3f} ms{moved / ms / 1e6:>10.0f} GB/s{moved / ms / 1e6 / copy_gbps:>10.1%} of copy")
    return {"bytes": moved // 2, "ms": rows, "of_copy": {k: moved / ms / 1e6 / copy_gbps for k, ms in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels: CUDA is not available; the Triton kernel benchmark needs a GPU. Skipped.")
        return 0
    copy_gbps = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbps:.0f} GB/s")
    figures = {
        "device": torch.cuda.get_device_name(),
        "copy_gbps": copy_gbps,
        "decode": bench_decode(args.batch, args.context, copy_gbps),
        "prefill": bench_prefill(),
        "block_copy": bench_block_copy(copy_gbps),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
