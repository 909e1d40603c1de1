"""Kernel benchmark: ``python -m benchmarks.gpu.kernels [--json FILE]`` (needs CUDA; exits 0 with a note without).

- Decode attention over int8 and e4m3 pools (#45, benchmarks/gpu/kv_decode.py): the first decode
  shape's time and bandwidth against the same case over bfloat16.
- Decode attention is memory bound: every step reads each request's whole K and V once. The figure
  of merit is the bandwidth the kernel achieves (K/V bytes read / time) as a fraction of what this
  device reaches on a plain large device-to-device copy (target >= 0.7), next to the torch reference.
- Prefill attention (causal, chunks over a paged cache) is compute bound: TFLOP/s of the Triton
  kernel against the torch reference (SDPA per request) on the same inputs.
- Block copy (gather a request's blocks into a send buffer, scatter them into a pool): bytes moved
  per second against torch's ``index_select`` / indexed assignment and the copy bandwidth.
- Batched LoRA (kernels/triton/lora_batched.py through engine/lora/stacked.py): one Llama-3-8B layer's four
  LoRA-capable projections with 4 rank-16 adapters on every projection, a decode batch and a prefill
  step mixed with base tokens; the kernel path against the engine's torch path (per adapter: gather,
  two matmuls, scatter-add), both as the engine calls them, once the step's grouping is made.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.gpu.kv_decode import bench_decode_kv_dtypes

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (batch, context) of the decode benchmark: the 64 x 2048, one long-context case and a wide
# short one; each picks a different split count, so all three are read against the copy bandwidth.
DECODE_SHAPES = [(64, 2048), (8, 16384), (256, 512)]
PREFILL_LENS = [512, 1024, 2048, 300, 77, 1500, 128, 900]  # one step's chunks, each its own whole prompt
COPY_LAYERS, COPY_POOL_BLOCKS, COPY_BLOCKS = 32, 1024, 256  # a 32-layer pool; one transfer of 4096 tokens
DTYPE = torch.bfloat16
TARGET_DECODE_OF_COPY = 0.7


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench``: launches queued back to back with no
    host sync between them (so host launch time hides behind the GPU, as it does in a served step),
    the L2 cache flushed before each, and the warm-up compiling whatever Triton needs outside the
    timed window."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
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
    from kernels.triton import paged_attention
    from kernels.triton.paged_attention import paged_attention_reference
    from kernels.triton.paged_decode import paged_decode_triton

    inputs = paged_inputs([1] * batch, [context] * batch)
    q, k_cache, v_cache, block_tables, context_lens, _, scale = inputs
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    ref_ms = time_ms(lambda: paged_attention_reference(*inputs), rep_ms=50)
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
    from kernels.triton.paged_prefill import paged_prefill_reference, paged_prefill_triton

    inputs = paged_inputs(PREFILL_LENS, PREFILL_LENS)
    # Causal attention: QK^T and PV over the visible half, 2 FLOPs per multiply-add.
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in PREFILL_LENS)
    triton_ms = time_ms(lambda: paged_prefill_triton(*inputs))
    ref_ms = time_ms(lambda: paged_prefill_reference(*inputs), rep_ms=50)
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
    from kernels.triton.block_copy import (
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


LORA_RANK, LORA_ADAPTERS = 16, 4
LORA_STEPS = {"decode 64": (64, 16), "decode 256": (256, 48), "prefill 2048": (2048, 512)}  # tokens, base tokens
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
}  # fmt: skip


def random_adapter(name: str, config, seed: int):
    """Rank LORA_RANK on every projection of layer 0, laid out as engine/lora/adapter.py fuses them."""
    from engine.lora.adapter import PROJECTIONS, LoRAAdapter, LoRAModule, part_sizes
    from engine.lora.stacked import part_columns

    gen = torch.Generator(device="cuda").manual_seed(seed)
    adapter = LoRAAdapter(name, "", LORA_RANK, 1.0, frozenset(PROJECTIONS), {})
    for fused, parts in part_sizes(config).items():
        rank_sum, out = LORA_RANK * len(parts), sum(o for o, _ in parts)
        a = torch.randn(rank_sum, parts[0][1], device="cuda", generator=gen, dtype=DTYPE) / parts[0][1] ** 0.5
        b = torch.zeros(out, rank_sum, device="cuda", dtype=DTYPE)
        row = 0
        for part, (o, _) in enumerate(parts):
            col = part_columns(adapter, fused)[part]
            block = torch.randn(o, LORA_RANK, device="cuda", generator=gen) / LORA_RANK**0.5
            b[row : row + o, col : col + LORA_RANK] = block.to(DTYPE)
            row += o
        adapter.modules[0, fused] = LoRAModule(a, b)
    return adapter


def mixed_lora_groups(adapters, num_tokens: int, num_base: int) -> list:
    """LoRAStep groups: the adapters round-robin over the non-base tokens, all shuffled with the base."""
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.tensor([i % len(adapters) for i in range(num_tokens - num_base)] + [-1] * num_base)
    slots = slots[torch.randperm(num_tokens, generator=gen)]
    return [((slots == i).nonzero().squeeze(1).cuda(), adapter) for i, adapter in enumerate(adapters)]


def bench_lora() -> dict:
    from engine.lora.adapter import part_sizes
    from engine.lora.manager import LoRAStep
    from engine.lora.stacked import StackedLoRA
    from engine.model.config import HFModelConfig

    config = HFModelConfig.from_hf_dict(LLAMA_8B)
    sizes = part_sizes(config)  # fused module -> (out, in) of its parts
    adapters = [random_adapter(f"a{i}", config, i) for i in range(LORA_ADAPTERS)]
    stacked = StackedLoRA(config, torch.device("cuda"))
    print(f"\nbatched LoRA: {LORA_ADAPTERS} rank-{LORA_RANK} adapters on every projection, a Llama-3-8B layer")
    print(f"{'step':<16}{'torch ms':>10}{'triton ms':>10}{'vs torch':>10}{'max |diff|':>12}{'stack ms':>12}")
    figures = {}
    for label, (num_tokens, num_base) in LORA_STEPS.items():
        groups = mixed_lora_groups(adapters, num_tokens, num_base)
        steps = {"torch": LoRAStep(groups), "triton": LoRAStep(groups, stacked.step(groups, num_tokens))}
        x = {f: torch.randn(num_tokens, parts[0][1], device="cuda", dtype=DTYPE) for f, parts in sizes.items()}
        y = {
            f: torch.randn(num_tokens, sum(o for o, _ in parts), device="cuda", dtype=DTYPE)
            for f, parts in sizes.items()
        }
        deltas = {}
        for name, step in steps.items():  # the four projections' outputs, once
            deltas[name] = [y[f].clone() for f in sizes]
            for fused, out in zip(sizes, deltas[name]):
                step.add_delta((0, fused), x[fused], out)
        diff = max((t.float() - k.float()).abs().max().item() for t, k in zip(deltas["torch"], deltas["triton"]))
        ms = {
            name: time_ms(lambda s=step: [s.add_delta((0, f), x[f], y[f]) for f in sizes])
            for name, step in steps.items()
        }

        # once per new adapter set (kept across steps): copying the set's weights into the kernel's stacks
        def build_stacks():
            fresh = StackedLoRA(config, torch.device("cuda")).step(groups, num_tokens)
            return [fresh.stacks.weights((0, f)) for f in sizes]

        stack_ms = time_ms(build_stacks, rep_ms=50)
        print(
            f"{label:<16}{ms['torch']:>10.3f}{ms['triton']:>10.3f}{ms['torch'] / ms['triton']:>9.2f}x{diff:>12.2e}"
            f"{stack_ms:>12.3f}"
        )
        figures[label] = {
            "tokens": num_tokens,
            "base_tokens": num_base,
            "ms": ms,
            "max_abs_diff": diff,
            "stack_ms": stack_ms,
        }
    return figures


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``64x2048,8x16384`` -> [(64, 2048), (8, 16384)]."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, sep, context = part.partition("x")
        if not sep or not batch.isdigit() or not context.isdigit() or int(batch) < 1 or int(context) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not BATCHxCONTEXT (positive integers)")
        shapes.append((int(batch), int(context)))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--decode-shapes",
        type=parse_shapes,
        default=DECODE_SHAPES,
        help="batch x context pairs, e.g. 64x2048,8x16384 (default: %(default)s)",
    )
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu.kernels: CUDA is not available; the Triton kernel benchmark needs a GPU. Skipped.")
        return 0
    copy_gbps = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbps:.0f} GB/s")
    figures = {
        "device": torch.cuda.get_device_name(),
        "copy_gbps": copy_gbps,
        "decode": [bench_decode(batch, context, copy_gbps) for batch, context in args.decode_shapes],
        # #45: the first shape's pool as int8 and e4m3 against bfloat16
        "decode_kv_dtypes": bench_decode_kv_dtypes(
            paged_inputs([1] * args.decode_shapes[0][0], [args.decode_shapes[0][1]] * args.decode_shapes[0][0]),
            time_ms,
            copy_gbps,
        ),
        "prefill": bench_prefill(),
        "block_copy": bench_block_copy(copy_gbps),
        "lora": bench_lora(),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
