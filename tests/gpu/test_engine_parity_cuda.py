"""Engine parity on CUDA: pdserve's greedy generation (scheduler, paged KV pool, Triton kernels, a mixed
batch with chunked prefill) against transformers ``generate`` on the same device in the same dtype, for
every family. Skipped without CUDA (tests/gpu/conftest.py).

- float32: token for token.
- bfloat16: two implementations round differently, so a greedy run may take the other branch where the
  top two candidates are within rounding of each other. Stated tolerance, against transformers' own
  log-probabilities over the common prefix (teacher-forced, bf16 on CUDA):
  * every token pdserve emits carries a log-probability within ``BF16_LOGPROB_TOL`` of transformers' for
    that token at that position (max error reported);
  * at the first position where the two greedy runs differ, transformers' token leads pdserve's by at
    most ``BF16_LOGPROB_TOL`` (a near tie, not a wrong token).
With PDSERVE_GPU_FIGURES=<file>, each case appends one JSON line (first divergence, max error) to it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cluster.make_model import make_model
from configs.loader import load_config
from engine.llm import LLM
from engine.sampling.params import SamplingParams

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [1, 5, 37, 300, 16, 129, 64, 700]  # block multiples, a 1-token prompt, chunked ones
NEW_TOKENS = 48
BF16_LOGPROB_TOL = 0.1  # bf16 keeps 8 mantissa bits; the CPU bf16 run of this test on tiny models erred <= 0.008


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity-models")


def model_dir(root, family: str, size: str):
    return make_model(family, size, root / f"{family}-{size}", seed=0)


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def pdserve_greedy(path, dtype: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """All prompts in one batch; prompts past 64 tokens prefill in chunks beside decode rows."""
    config = load_config(
        None,
        env={},
        overrides={
            "model.dtype": dtype,
            "engine.block_size": 16,
            "engine.kv_cache_memory_mb": 512,
            "engine.prefill_chunk_size": 64,
            "engine.max_num_batched_tokens": 256,
        },
    )
    llm = LLM(str(path), config=config, device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [entry.logprob for entry in o.logprobs]) for o in outputs]


def transformers_model(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").to("cuda").eval()
    hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS, like ignore_eos
    return hf


@torch.inference_mode()
def transformers_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def transformers_logprobs(hf, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab]: log-probabilities of each next token, teacher-forced on ``continuation``."""
    ids = torch.tensor([prompt + continuation], device="cuda")
    logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # the positions that predict the continuation
    return logits.log_softmax(-1)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def record(figures: dict) -> None:
    path = os.environ.get("PDSERVE_GPU_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(figures) + "\n")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_fp32_greedy_equals_transformers_token_for_token(model_root, family, size):
    path = model_dir(model_root, family, size)
    hf = transformers_model(path, torch.float32)
    prompts = prompts_for(hf.config.vocab_size)
    ours = pdserve_greedy(path, "float32", prompts)
    for i, (prompt, (tokens, _)) in enumerate(zip(prompts, ours)):
        expected = transformers_greedy(hf, prompt)
        assert tokens == expected, f"prompt {i} ({len(prompt)} tokens) diverges at {first_divergence(tokens, expected)}"
    record({"test": "parity_fp32", "family": family, "size": size, "prompts": len(prompts), "exact": True})


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_matches_transformers_within_tolerance(model_root, family):
    path = model_dir(model_root, family, "small")
    hf = transformers_model(path, torch.bfloat16)
    prompts = prompts_for(hf.config.vocab_size)
    ours = pdserve_greedy(path, "bfloat16", prompts)
    max_error, divergences = 0.0, []
    for i, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, ours)):
        reference = transformers_logprobs(hf, prompt, tokens)  # [NEW_TOKENS, vocab]
        ours_lp = torch.tensor(logprobs, device="cuda")
        theirs_lp = reference.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        max_error = max(max_error, (ours_lp - theirs_lp).abs().max().item())
        expected = transformers_greedy(hf, prompt)
        at = first_divergence(tokens, expected)
        if at is not None:  # the same prefix up to ``at``: the reference row there judges both choices
            lead = (reference[at, expected[at]] - reference[at, tokens[at]]).item()
            divergences.append({"prompt": i, "position": at, "lead": lead})
            assert lead <= BF16_LOGPROB_TOL, f"prompt {i}: transformers' token leads ours by {lead:.3f} at {at}"
    record(
        {
            "test": "parity_bf16",
            "family": family,
            "size": "small",
            "prompts": len(prompts),
            "max_logprob_error": max_error,
            "tolerance": BF16_LOGPROB_TOL,
            "divergences": divergences,
            "identical_prompts": len(prompts) - len(divergences),
        }
    )
    assert max_error <= BF16_LOGPROB_TOL, f"max |log-prob error| {max_error:.3f} > {BF16_LOGPROB_TOL}"
