"""LoRA overhead in the engine: the same seeded workload run on the base model alone and with 4
adapters mixed evenly (request i under adapter i mod 4), in one process, one after the other.

    python -m benchmarks.engine.lora_throughput [--model DIR] [--num-requests N] [--rank R]

The adapters are random PEFT directories of rank R on every projection (q/k/v/o/gate/up/down: the
most work an adapter can add), written to a temporary directory. ``--max-loras 4`` holds all four in
device slots, so the number is the gathered LoRA product's cost, not paging. The last line is

    lora_vs_base=<tok/s with adapters / tok/s base>   (the issue's target: >= 0.8 on CPU)

This is the engine's offline throughput (``LLM.generate``), not a served run through ``pdserve serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common.workload import WorkloadSpec, make_workload
from benchmarks.engine.throughput import resolve_model_dir
from engine.lora.adapter import PROJECTIONS, part_sizes
from engine.model.config import HFModelConfig

NUM_ADAPTERS = 4


def write_adapter(out: Path, config: HFModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter directory of ``rank`` on every projection."""
    g = torch.Generator().manual_seed(seed)
    sizes = part_sizes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (fused, part) in PROJECTIONS.items():
            out_features, in_features = sizes[fused][part]
            group = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)})
    )
    return out


def run(llm, requests, names: list[str]) -> tuple[float, int]:
    from engine.sampling.params import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, lora_name=names[i % len(names)])
        for i, r in enumerate(requests)
    ]
    llm.generate([list(requests[0].prompt_token_ids[:16])], params[:1])  # warm-up
    start = time.perf_counter()
    results = llm.generate([list(r.prompt_token_ids) for r in requests], params)
    return time.perf_counter() - start, sum(len(res.outputs[0].token_ids) for res in results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.lora_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.llm import LLM

    model_dir = resolve_model_dir(args.model)
    config = HFModelConfig.from_hf_dir(model_dir)
    requests = make_workload(WorkloadSpec(config.vocab_size, args.num_requests, (64, 256), (32, 96), seed=0))
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        modules = [f"a{i}={write_adapter(Path(tmp) / f'a{i}', config, args.rank, i)}" for i in range(NUM_ADAPTERS)]
        llm = LLM(
            str(model_dir), enable_lora=True, lora_modules=modules, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank
        )
        base_s, base_tokens = run(llm, requests, [""])
        lora_s, lora_tokens = run(llm, requests, [f"a{i}" for i in range(NUM_ADAPTERS)])
    base_tps, lora_tps = base_tokens / base_s, lora_tokens / lora_s
    print(f"model {model_dir}, {len(requests)} requests, {args.threads} threads, rank {args.rank} on every projection")
    print(f"base alone          {base_tokens} tokens in {base_s:.2f} s: {base_tps:.1f} tok/s")
    print(f"{NUM_ADAPTERS} adapters mixed    {lora_tokens} tokens in {lora_s:.2f} s: {lora_tps:.1f} tok/s")
    print(f"lora_vs_base={lora_tps / base_tps:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
