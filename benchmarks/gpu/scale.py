"""An 8B-class model on one GPU, with dummy weights: ``python -m benchmarks.gpu.scale [--shape llama3-8b]
[--device cuda] [--json FILE]`` (issue #48). ``--shape tiny --device cpu`` is the dry run (tests).

The model is made from config.json alone (``model.load_format: dummy``: random weights on the device
in the target dtype; cluster/make_model.py's ``llama3-8b`` shape: 32 layers, hidden 4096, intermediate
14336, 32/8 heads, vocab 128256). transformers builds the same config with random weights on the same
device in the same dtype. Every figure is set against something measured in the same run:

- ``copy_gbps``: one large device-to-device copy (bytes read + written per second), the HBM ceiling;
  ``matmul_tflops``: one large matmul in the run's dtype, the compute ceiling.
- decode: output tokens/s at each batch (1, 16, 64, 256) with 1k-token prompts, greedy, every request
  the same length. pdserve: its engine steps timed one by one, the last N - 1 of a 1 + N token run are
  pure decode steps. transformers' ``generate`` (static batch): (a run of 1 + N tokens) - (a run of 1
  token) over batch * N, so its prefill cancels out. Both against the roofline (benchmarks/gpu/roofline.py).
- prefill: one ``--prefill-tokens`` prompt (8k) to its first token: achieved TFLOP/s / matmul_tflops.
- transfer: a ``--transfer-tokens`` prompt's KV (4k: 512 MiB at the 8B shape in bfloat16) copied between
  two pools on the device by the transfer plane's block copy (kvtransfer/block_runs.py), timed as the
  sender times it (kvtransfer/copy_timing.py): bandwidth / copy_gbps, and its share of that prompt's
  TTFT. Between processes over cuda_ipc the same copy runs (``benchmarks.transfer.pd_parity``).

Last line: ``scale: decode_b1_of_roofline=<r> decode_b64_tps=<x> decode_b256_tps=<y> vs_hf_b64=<z>
prefill_of_matmul=<p> transfer_of_copy=<t> transfer_share_of_ttft=<s>``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.gpu.roofline import Shape, roofline_tokens_per_s


@dataclass(slots=True)
class Plan:
    batches: list[int]
    context: int
    new_tokens: int
    prefill_tokens: int
    transfer_tokens: int
    kv_cache_mb: int
    hf_batches: list[int] = field(default_factory=list)
    copy_bytes: int = 1 << 30


PLANS = {
    # 256 x 1k tokens of KV is 34 GB at this shape; weights 16 GB: both fit an H100 80 GB / H200.
    # transformers at batches 1 and 64 only (the comparison at 64): within gpu-check's budget.
    "llama3-8b": Plan([1, 16, 64, 256], 1024, 32, 8192, 4096, 40_000, [1, 64]),
    "tiny": Plan([1, 4], 64, 4, 256, 128, 64, [1, 4], 16 << 20),
}
SIZES = {"llama3-8b": ("llama", "llama3-8b"), "tiny": ("llama", "tiny")}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall(device: str, fn) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def best_ms(device: str, fn, repeats: int = 5) -> float:
    """CUDA: triton.testing.do_bench's median (no sync per iteration); CPU: best wall time."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    return min(wall(device, fn) for _ in range(repeats)) * 1e3


def copy_gbps(device: str, num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_ms(device, lambda: dst.copy_(src)) / 1e6


def matmul_tflops(device: str, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / best_ms(device, lambda: a @ b) / 1e9


def config_dir(shape: str, root: Path) -> Path:
    """config.json only: the weights are made by the dummy loader."""
    from cluster.make_model import build_config

    family, size = SIZES[shape]
    build_config(family, size).save_pretrained(root)
    return root


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, length), generator=gen).tolist()


def pdserve_figures(path: Path, plan: Plan, device: str, dtype: str, vocab: int) -> dict:
    from configs.loader import load_config
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    overrides = {
        "model.dtype": dtype,
        "model.load_format": "dummy",
        "engine.kv_cache_memory_mb": plan.kv_cache_mb,
        "engine.max_num_seqs": max(plan.batches),
        "engine.max_num_batched_tokens": max(plan.prefill_tokens, plan.context),
        "engine.prefill_chunk_size": plan.prefill_tokens,
        "engine.enable_prefix_caching": False,  # the 1 + N run must prefill again, as the 1-token run did
    }
    llm = LLM(str(path), config=load_config(None, env={}, overrides=overrides), device=device)

    def run(prompts, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return wall(device, lambda: llm.generate(prompts, params))

    def decode_tps(prompts) -> float:
        """One run of 1 + N tokens, each engine step timed: the last N - 1 steps are pure decode (every
        prompt's prefill ended in an earlier step), one token per request each."""
        params = SamplingParams(temperature=0.0, max_tokens=1 + plan.new_tokens, ignore_eos=True)
        for prompt in prompts:
            llm.engine.add_request(list(prompt), params)
        steps = []
        while llm.engine.has_unfinished():
            steps.append(wall(device, llm.engine.step))
        decode = steps[-(plan.new_tokens - 1) :]
        assert len(steps) > len(decode), f"{len(steps)} steps for {plan.new_tokens} new tokens"
        return len(prompts) * len(decode) / sum(decode)

    run(random_prompts(2, 32, vocab, 0), 4)  # warm-up: kernels compile outside the timed runs
    figures = {"decode_tps": {}}
    for batch in plan.batches:
        prompts = random_prompts(batch, plan.context, vocab, batch)
        run(prompts[:1], 3)  # kernel variants of a new batch size compile here
        figures["decode_tps"][batch] = decode_tps(prompts)
    figures["prefill_s"] = run(random_prompts(1, plan.prefill_tokens, vocab, 1), 1)
    figures["transfer_prompt_ttft_s"] = run(random_prompts(1, plan.transfer_tokens, vocab, 2), 1)
    return figures  # the engine (and its KV pool) goes with this frame


def transformers_figures(path: Path, plan: Plan, device: str, dtype: torch.dtype, vocab: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()

    def run(prompts, tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            return wall(device, lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs))

    run(random_prompts(2, 32, vocab, 0), 4)
    figures = {"decode_tps": {}}
    for batch in plan.hf_batches:
        prompts = random_prompts(batch, plan.context, vocab, batch)
        first, whole = run(prompts, 1), run(prompts, 1 + plan.new_tokens)
        figures["decode_tps"][batch] = batch * plan.new_tokens / max(whole - first, 1e-9)
    figures["prefill_s"] = run(random_prompts(1, plan.prefill_tokens, vocab, 1), 1)
    return figures


def transfer_figures(shape: Shape, plan: Plan, device: str, dtype: torch.dtype) -> dict:
    """A prompt's blocks copied pool to pool as the sender does it: consecutive ids (one strided copy
    per run, what the allocator mostly hands out) and scattered ids (gather + scatter)."""
    from engine.kv.pool import KVLayout
    from kvtransfer.block_runs import copy_blocks
    from kvtransfer.copy_timing import CopyStopwatch

    block_size = 16
    blocks = -(-plan.transfer_tokens // block_size)
    layout = KVLayout(shape.layers, 2 * blocks, block_size, shape.kv_heads, shape.head_dim, dtype)
    src = torch.randn(layout.shape, device=device, dtype=dtype)
    dst = torch.zeros_like(src)
    order = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(0)).tolist()
    cases = {
        "consecutive": (list(range(blocks)), list(range(blocks, 2 * blocks))),
        "scattered": (order[:blocks], order[blocks:]),
    }
    out = {"bytes": blocks * layout.bytes_per_block, "blocks": blocks}
    for name, (src_ids, dst_ids) in cases.items():
        times = []
        for _ in range(5):
            with (watch := CopyStopwatch(torch.device(device))):
                copy_blocks(src, src_ids, dst, dst_ids)
            times.append(watch.seconds())
        assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])  # the copy is the real one
        out[f"{name}_s"] = sorted(times)[len(times) // 2]
    del src, dst
    return out


def summarize(shape: Shape, plan: Plan, element_bytes: int, ceilings: dict, ours: dict, hf: dict, moved: dict) -> dict:
    copy = ceilings["copy_gbps"]
    decode = {
        b: {
            "tps": tps,
            "roofline_tps": (roof := roofline_tokens_per_s(shape, b, plan.context, element_bytes, copy)),
            "of_roofline": tps / roof,
            "hf_tps": hf["decode_tps"].get(b),
            "vs_hf": tps / hf["decode_tps"][b] if b in hf["decode_tps"] else None,
        }
        for b, tps in ours["decode_tps"].items()
    }
    flops = shape.prefill_flops(plan.prefill_tokens)
    prefill_tflops = flops / ours["prefill_s"] / 1e12
    transfer_s = moved["consecutive_s"]
    return {
        "plan": asdict(plan),
        "shape": asdict(shape),
        **ceilings,
        "decode": decode,
        "prefill": {
            "tokens": plan.prefill_tokens,
            "seconds": ours["prefill_s"],
            "tflops": prefill_tflops,
            "of_matmul": prefill_tflops / ceilings["matmul_tflops"],
            "hf_seconds": hf["prefill_s"],
            "hf_tflops": flops / hf["prefill_s"] / 1e12,
        },
        "transfer": {
            **moved,
            "gbps": moved["bytes"] / transfer_s / 1e9,
            # the copy reads and writes its bytes, as copy_gbps counts them
            "of_copy": 2 * moved["bytes"] / transfer_s / 1e9 / copy,
            "ttft_s": ours["transfer_prompt_ttft_s"],
            "share_of_ttft": transfer_s / ours["transfer_prompt_ttft_s"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.scale", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(PLANS), default="llama3-8b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bfloat16 on cuda")
    p.add_argument("--json", help="write the figures to this file too")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.gpu.scale: --device cuda, but torch sees no CUDA device")
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    plan = PLANS[args.shape]
    from engine.model.config import HFModelConfig

    with tempfile.TemporaryDirectory(prefix="pdserve-scale-") as tmp:
        path = config_dir(args.shape, Path(tmp))
        shape = Shape.of(HFModelConfig.from_hf_dir(path))
        element_bytes = torch.empty((), dtype=dtype).element_size()
        ceilings = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": dtype_name,
            "copy_gbps": copy_gbps(args.device, plan.copy_bytes),
            "matmul_tflops": matmul_tflops(args.device, dtype, plan.prefill_tokens, shape.hidden, shape.intermediate),
        }
        print(f"scale: {args.shape} on {ceilings['device']} in {dtype_name}; {ceilings}", flush=True)
        ours = pdserve_figures(path, plan, args.device, dtype_name, shape.vocab)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # transformers needs the memory the engine's pool held
        moved = transfer_figures(shape, plan, args.device, dtype)
        hf = transformers_figures(path, plan, args.device, dtype, shape.vocab)
    figures = summarize(shape, plan, element_bytes, ceilings, ours, hf, moved)
    print(json.dumps(figures, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    d, first, widest = figures["decode"], plan.batches[0], plan.batches[-1]
    mid = 64 if 64 in d else plan.hf_batches[-1]
    print(
        f"scale: decode_b{first}_of_roofline={d[first]['of_roofline']:.3f} decode_b{mid}_tps={d[mid]['tps']:.0f} "
        f"decode_b{widest}_tps={d[widest]['tps']:.0f} vs_hf_b{mid}={d[mid]['vs_hf']:.2f} "
        f"prefill_of_matmul={figures['prefill']['of_matmul']:.3f} "
        f"transfer_of_copy={figures['transfer']['of_copy']:.3f} "
        f"transfer_share_of_ttft={figures['transfer']['share_of_ttft']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
