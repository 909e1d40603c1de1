"""Decode attention benchmark: ``python -m benchmarks.kernels`` (needs CUDA; exits 0 with a note without).

Decode is memory bound: every step reads each request's whole K and V once. The figure of merit is
the bandwidth the kernel achieves (K/V bytes read / time) as a fraction of what this device reaches on
a plain large device-to-device copy, next to the time of the torch reference on the same inputs.
"""

from __future__ import annotations

import argparse
import sys

import torch

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 2048, 32, 8, 128, 16
DTYPE = torch.bfloat16


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


def decode_inputs(batch: int, context: int):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    # Shuffled block ids: a real pool hands out blocks in no particular order.
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, block_tables, context_lens, query_start_loc, HEAD_DIM**-0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels: CUDA is not available; the Triton kernel benchmark needs a GPU. Skipped.")
        return 0

    from kernels import paged_attention
    from kernels.paged_attention import paged_attention_reference
    from kernels.paged_decode import paged_decode_triton

    copy_gbps = copy_bandwidth_gbps()
    inputs = decode_inputs(args.batch, args.context)
    q, k_cache, v_cache, block_tables, context_lens, _, scale = inputs
    kv_bytes = 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbps:.0f} GB/s")
    print(f"decode: batch {args.batch} x context {args.context}, {HEADS} q / {KV_HEADS} kv heads, "
          f"head dim {HEAD_DIM}, block size {BLOCK_SIZE}, {DTYPE}; K/V read {kv_bytes / 1e6:.0f} MB")

    ref_ms = time_ms(lambda: paged_attention_reference(*inputs), iters=10)
    rows = [("triton (auto splits)", time_ms(lambda: paged_attention(*inputs)))]
    for splits in (1, 2, 4, 8):
        run = lambda s=splits: paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=s)
        rows.append((f"triton, {splits} split(s)", time_ms(run)))
    expected = paged_attention_reference(*inputs).float()
    error = (paged_attention(*inputs).float() - expected).abs().max().item()

    print(f"{'variant':<24}{'time ms':>10}{'GB/s':>10}{'of copy':>10}{'vs torch':>10}")
    for name, ms in rows + [("torch reference", ref_ms)]:
        gbps = kv_bytes / ms / 1e6
        print(f"{name:<24}{ms:>10.3f}{gbps:>10.0f}{gbps / copy_gbps:>10.1%}{ref_ms / ms:>9.1f}x")
    print(f"max |triton - reference| = {error:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
