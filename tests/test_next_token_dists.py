"""benchmarks/engine/next_token_dists.py: the whole next-token rows it captures are the engine's own
(their log-prob of each prompt token is the engine's prompt_logprobs, across prefill chunks), and its
divergence figures are torch's KL divergence and argmax agreement."""

from __future__ import annotations

import math

import torch

from benchmarks.engine.next_token_dists import divergence, scored_rows, windows_rows
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.model_factory import tiny_model_dir
from tests.test_engine_generate import random_prompts


def test_captured_rows_are_the_engines_prompt_logprobs_across_chunks():
    llm = LLM(str(tiny_model_dir("llama")), block_size=16, prefill_chunk_size=24, kv_cache_memory_mb=8)
    [tokens] = random_prompts([61], 768, seed=4)  # 3 prefill chunks
    rows = scored_rows(llm, tokens)
    assert rows.shape == (61 - 1 - 61 // 2, llm.engine.runner.model.config.vocab_size)
    [out] = llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    want = [e.logprob for e in out.prompt_logprobs[61 // 2 + 1 :]]  # tokens 31..60, predicted by positions 30..59
    got = rows.gather(1, torch.tensor(tokens[61 // 2 + 1 :])[:, None])[:, 0].tolist()
    assert got == want
    assert torch.allclose(rows.exp().sum(-1), torch.ones(rows.shape[0]), atol=1e-5)  # whole distributions


def test_windows_are_consecutive_and_targets_are_the_scored_tokens():
    llm = LLM(str(tiny_model_dir("llama")), block_size=16, kv_cache_memory_mb=8)
    [ids] = random_prompts([40], 768, seed=5)
    rows, targets = windows_rows(llm, ids, 20, 2)
    assert targets.tolist() == ids[11:20] + ids[31:40]
    assert torch.equal(rows[9:], scored_rows(llm, ids[20:40]))


def test_divergence_is_torchs_kl_and_argmax_agreement():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50, 7, generator=g).log_softmax(-1)
    tested = (base + 0.3 * torch.randn(50, 7, generator=g)).log_softmax(-1)
    targets = torch.randint(0, 7, (50,), generator=g)
    d = divergence(base, tested, targets)
    per_row = torch.nn.functional.kl_div(tested, base, log_target=True, reduction="none").sum(-1)
    assert math.isclose(d.mean_kld, per_row.mean().item(), rel_tol=1e-5)
    assert math.isclose(d.max_kld, per_row.max().item(), rel_tol=1e-5)
    assert d.same_top1 == (base.argmax(-1) == tested.argmax(-1)).double().mean().item()
    nll_shift = (base.gather(1, targets[:, None]) - tested.gather(1, targets[:, None])).mean().item()
    assert math.isclose(d.ln_ppl_ratio, nll_shift, rel_tol=1e-6, abs_tol=1e-9)
    same = divergence(base, base, targets)
    assert same.mean_kld == 0.0 and same.same_top1 == 1.0 and same.max_abs_dlogprob == 0.0
