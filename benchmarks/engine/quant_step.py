"""Where one decode step's time goes on a quantized GGUF file at few rows, against the memory's speed:

    python -m benchmarks.engine.quant_step [--format q8_0] [--rows 1] [--rounds 15] [--steps 10] [--threads 2]

The engine (the file from benchmarks/peers/gguf_variants.py) decodes ``--rows`` sequences of 256-token
prompts; then, alternated round by round, each timed over ``--steps`` calls: the whole engine step
(``LLMEngine.step``: scheduler, step inputs, the layers, LM head, sampler), the decoder layers' one C call
alone (engine/model/decode_step.py, the step's captured inputs) with kernels/cpu/decode_step_team.c on and
off (``regions``: a parallel region per kernel call, as before it), the LM head alone (final norm and
the head in the file's format), and a read of the same bytes on the same threads (torch's sum of a
float32 tensor as large as the step's weights: the machine's streaming speed here). Printed, medians:
ms per call, the GB/s of weights each streams, and the rest of the engine step (Python: scheduler,
sampler, inputs) as engine step - layers - head. On a shared machine read the ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.engine.quant_decode import _weight_bytes
from benchmarks.engine.step_profile import decoding_engine
from benchmarks.peers import gguf_variants
from engine.llm import LLM


def _layer_bytes(model) -> int:
    return sum(
        _weight_bytes(m)
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )


def _captured_layers_call(engine):
    """A call of the fused step with the inputs of the engine's next step (captured by running it)."""
    fused = engine.runner.model.fused_decode
    assert fused is not None, "this model's decode steps do not take the fused step"
    captured = []
    run = fused.run
    fused.run = lambda *args: captured.append(args) or run(*args)
    try:
        engine.step()
    finally:
        fused.run = run
    assert captured, "the step did not take the fused step"
    x, *rest = captured[0]
    return lambda: run(x.clone(), *rest)


def _ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="q8_0", choices=[f for f in gguf_variants.FORMATS if f != "f32"])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(str(gguf_variants.gguf_file(args.format)), kv_cache_memory_mb=64, num_threads=args.threads)
    model = llm.engine.runner.model
    engine = decoding_engine(llm, args.rows, max_tokens=2 * args.rounds * args.steps + 16)
    layers = _captured_layers_call(engine)
    shape, team = model.fused_decode.shape, model.fused_decode.shape.quant_team
    hidden = torch.randn(args.rows, model.config.hidden_size)
    layer_bytes = _layer_bytes(model)
    head_bytes = _weight_bytes(model.quantized_head) if model.quantized_head is not None else 0
    block = torch.ones((layer_bytes + head_bytes) // 4)

    def regions() -> None:
        shape.quant_team = None
        try:
            layers()
        finally:
            shape.quant_team = team

    timed = {
        "engine step": engine.step,
        "layers, team": layers,
        "layers, regions": regions,
        "LM head": lambda: model.compute_logits(hidden),
        "read the bytes": block.sum,
    }
    ms: dict[str, list[float]] = {name: [] for name in timed}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in timed.items():
                ms[name].append(_ms(fn, args.steps))
    median = {name: statistics.median(v) for name, v in ms.items()}
    streamed = {"layers, team": layer_bytes, "layers, regions": layer_bytes, "LM head": head_bytes}
    streamed["read the bytes"] = block.numel() * 4
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"# {args.format}, {args.rows} rows, {args.threads} threads, {args.rounds} rounds alternated, load {load}")
    print(f"# weights a step streams: layers {layer_bytes / 1e6:.1f} MB, LM head {head_bytes / 1e6:.1f} MB")
    for name, value in median.items():
        line = f"{name}: {value:.3f} ms"
        if name in streamed:
            line += f", {streamed[name] / value / 1e6:.1f} GB/s"
        print(line)
    rest = median["engine step"] - median["layers, team"] - median["LM head"]
    print(f"engine step - layers (team) - LM head: {rest:.3f} ms (scheduler, inputs, sampler, Python)")
    print(f"vs_regions={median['layers, regions'] / median['layers, team']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
