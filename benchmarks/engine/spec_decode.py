"""Speculative decoding on the real SmolLM2-135M: pdserve with and without n-gram speculation, side
by side in one run, and llama-server with its own n-gram speculation on the same GGUF.

    python -m benchmarks.engine.spec_decode [--streams 1,4,16] [--max-tokens 128] [--rounds 2]
        [--llama-server PATH] [--spec NAME=JSON ...]

For each workload (benchmarks/engine/spec_workloads.py) and stream count, the two pdserve engines (one
process, the same threads) run the same greedy requests alternately, ``--rounds`` times each. Reported
per system: decode ITL p50/p99 (each step's time shared by the tokens it gave a request) and output
tokens/s over the decode phase (first token to last, so prompt processing is out of both). Lines:

    spec_copy streams=1 plain: itl_p50=..ms itl_p99=..ms tok/s=..   spec: ...   spec_speedup=<spec/plain>

Each ``--spec NAME=JSON`` adds a speculating engine beside ``spec`` (SPEC), e.g. another
``num_speculative_tokens``; every engine's speedup is over ``plain`` of the same run.

With ``--llama-server`` the same prompts run one at a time against llama-server on the GGUF (Q4_1, as
shipped) with and without ``--spec-type ngram-simple``; its decode rate is its own ``timings``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.engine.spec_workloads import chat_prompts, smollm2_checkpoint
from engine.llm import LLM
from engine.sampling.params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], float, int]:
    """(per-token ITLs in s, seconds from the first request's first token to the last token, tokens
    decoded after each request's first). Each step's time is shared by the tokens it gave a request."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = {s.seq_id: s for s in engine.scheduler.waiting}
    last_emit: dict[int, float] = {}
    first_at: dict[int, float] = {}
    counts = dict.fromkeys(ids, 0)
    itls: list[float] = []
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for rid in ids:
            n = seqs[rid].num_output_tokens
            new = n - counts[rid]
            if new <= 0:
                continue
            if rid in last_emit:
                itls += [(now - last_emit[rid]) / new] * new
            else:
                first_at[rid] = now  # the first token ends the prompt phase: no ITL for it
            counts[rid] = n
            last_emit[rid] = now
    start = min(first_at.values())
    end = max(last_emit.values())
    decoded = sum(counts.values()) - len(ids)
    return itls, end - start, decoded


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--workloads", default="spec_copy,spec_free")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", action="append", default=[], help="NAME=JSON: another speculating engine")
    args = ap.parse_args()
    path = str(smollm2_checkpoint())
    common = dict(num_threads=args.threads, kv_cache_memory_mb=256, max_num_seqs=32)
    systems = {
        "plain": LLM(path, **common),
        "spec": LLM(path, speculative_config=json.dumps(SPEC), **common),
    }
    for entry in args.spec:
        name, _, config = entry.partition("=")
        systems[name] = LLM(path, speculative_config=config, **common)
    tok = systems["plain"].tokenizer
    for workload in args.workloads.split(","):
        for streams in [int(s) for s in args.streams.split(",")]:
            texts = chat_prompts(workload, streams)
            prompts = [chat_ids(tok, t) for t in texts]
            results = {name: ([], 0.0, 0) for name in systems}
            for llm in systems.values():  # warm-up: the forms cache and the first steps' allocations
                run_engine(llm, prompts[:1], 8)
            for _ in range(args.rounds):
                for name, llm in systems.items():
                    itls, seconds, tokens = run_engine(llm, prompts, args.max_tokens)
                    old = results[name]
                    results[name] = (old[0] + itls, old[1] + seconds, old[2] + tokens)
            line = [f"{workload} streams={streams}"]
            rates = {}
            for name, (itls, seconds, tokens) in results.items():
                rates[name] = tokens / seconds
                line.append(
                    f"{name}: itl_p50={percentile(itls, 0.5) * 1e3:.1f}ms itl_p99={percentile(itls, 0.99) * 1e3:.1f}ms "
                    f"tok/s={rates[name]:.1f}"
                )
            for name in list(systems)[1:]:
                spec = systems[name].engine.scheduler.speculator
                line.append(f"{name}_speedup={rates[name] / rates['plain']:.2f}")
                line.append(f"{name}_acceptance={spec.num_accepted_tokens}/{spec.num_draft_tokens}")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
