"""Speculative decoding through the engine: greedy output with n-gram speculation equals the output
without it, token for token, on every family; under continuous batching with speculating and plain
sequences, and with preemption; the prefix cache never holds a block with a rejected draft; sampled
output keeps the target distribution (chi-square against the exact distribution from transformers).
Every scenario ends with the leak check."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from protocol.hashing import block_hashes
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.test_spec_rejection import CHI2_001, chi_square

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def spec_config(k: int = 4, lookup_max: int = 3, max_num_seqs: int = 64) -> str:
    # min_acceptance 0 and no verify cost: every proposal is verified, so rejections happen (the back-off
    # is tested on its own).
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": lookup_max,
            "max_num_seqs": max_num_seqs,
            "min_acceptance": 0.0,
            "verify_row_cost": 0.0,
        }
    )


def copy_prompts(seed: int, vocab: int = 700) -> list[list[int]]:
    """Prompts that repeat a span (so lookups find proposals), plain random ones, and every token id once
    in random order (every token has a lookup match, followed by a random guess that gets rejected)."""
    g = torch.Generator().manual_seed(seed)
    spans = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (20, 37, 9, 64)]
    every = [t for t in torch.randperm(vocab, generator=g).tolist() if t >= 5]
    plain = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (1, 33)]
    # A model that repeats its last token (tiny random qwen2 does) finds "a a" early in this one,
    # followed by other tokens: a wrong guess.
    a, rest = plain[1][0], plain[1][1:]
    return [s + s + s[: len(s) // 2] for s in spans] + plain + [every, [a, a, *rest, a]]


@functools.cache
def plain_output(family: str, block_size: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = copy_prompts(seed=3)
    llm = LLM(str(tiny_model_dir(family)), block_size=block_size, kv_cache_memory_mb=8)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def assert_cache_holds_only_real_tokens(llm: LLM, sequences: list[list[int]]) -> None:
    """Every hash in the prefix cache is the hash of a block of some request's final tokens: a block
    holding a rejected draft would hash differently."""
    bm = llm.engine.block_manager
    real = {h for tokens in sequences for h in block_hashes(tokens, bm.block_size)}
    stray = [h for h in bm.block_hash if h is not None and h not in real]
    assert not stray, f"{len(stray)} cached blocks hold tokens no request produced"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_ngram_speculation_equals_plain_decoding(family: str, block_size: int) -> None:
    prompts, expected = plain_output(family, block_size)
    llm = LLM(
        str(tiny_model_dir(family)), block_size=block_size, kv_cache_memory_mb=8, speculative_config=spec_config()
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} diverges at token {next(j for j in range(len(e)) if g[j] != e[j])}"
    spec = llm.engine.scheduler.speculator
    assert spec.num_accepted_tokens > 0, "no draft was accepted: the test exercises nothing"
    assert spec.num_accepted_tokens < spec.num_draft_tokens, "no draft was rejected: the rollback is untested"
    assert spec.num_accepted_per_pos[0] >= spec.num_accepted_per_pos[-1]
    assert_no_leak(llm.engine.block_manager)
    assert_cache_holds_only_real_tokens(llm, [p + o for p, o in zip(prompts, got)])
    # The cache is reused: a request continuing a finished one hits its blocks and must still agree.
    follow = prompts[0] + expected[0][:20]
    again = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == expected[0][20:40]
    assert_no_leak(llm.engine.block_manager)


def test_mixed_speculating_and_plain_sequences_with_preemption() -> None:
    """Speculating sequences beside ones that cannot speculate (logprobs, a penalty), in a pool so small
    that sequences are preempted and recomputed: each output equals its plain run alone."""
    family = "qwen2"
    prompts = [p for p in plain_output(family, 8)[0] if len(p) < 200]  # each fits the small pool
    plain_only = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
    ]
    params = [plain_only[i // 2] if i in (1, 3) else GREEDY for i in range(len(prompts))]
    alone = []
    plain = LLM(str(tiny_model_dir(family)), block_size=8, kv_cache_memory_mb=8)
    for prompt, p in zip(prompts, params):
        alone.append(plain.generate([prompt], p)[0].outputs[0].token_ids)
    llm = LLM(
        str(tiny_model_dir(family)),
        block_size=8,
        num_kv_blocks=40,
        enable_prefix_caching=False,
        speculative_config=spec_config(),
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == alone
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert llm.engine.scheduler.speculator.num_accepted_tokens > 0
    assert_no_leak(llm.engine.block_manager)


def test_back_off_when_the_batch_is_large() -> None:
    prompts, expected = plain_output("llama", 16)
    llm = LLM(
        str(tiny_model_dir("llama")),
        block_size=16,
        kv_cache_memory_mb=8,
        speculative_config=spec_config(max_num_seqs=len(prompts) - 1),
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    spec = llm.engine.scheduler.speculator
    # Drafts only once some sequences have finished and the batch is at most max_num_seqs (none here:
    # all run to max_tokens together).
    assert spec.num_drafts == 0
    assert_no_leak(llm.engine.block_manager)


ALLOWED = [11, 12, 13, 14]  # a tiny vocabulary: the exact distribution has 16 cells over two tokens


def exact_two_token_distribution(family: str, prompt: list[int]) -> dict[tuple[int, int], float]:
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32).eval()

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1, ALLOWED].double()
        return logits.softmax(0)

    first = next_probs(prompt)
    return {
        (a, b): float(first[i] * pb)
        for i, a in enumerate(ALLOWED)
        for b, pb in zip(ALLOWED, next_probs(prompt + [a]).tolist())
    }


def test_sampled_speculation_keeps_the_target_distribution() -> None:
    """Every pair (t0, t1) of allowed tokens occurs in the prompt, so the second token (the first a decode
    step verifies drafts for) always comes with drafts; the pairs' frequencies over many seeded requests must match the exact
    joint distribution (chi-square, alpha 0.001)."""
    family = "llama"
    prompt = [5, 11, 11, 12, 11, 13, 11, 14, 12, 12, 13, 12, 14, 13, 13, 14, 14, 11, 5]
    expected = exact_two_token_distribution(family, prompt)
    llm = LLM(
        str(tiny_model_dir(family)),
        block_size=8,
        kv_cache_memory_mb=16,
        max_num_seqs=256,
        speculative_config=spec_config(k=3, lookup_max=2, max_num_seqs=256),
    )
    num = 2400
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=ALLOWED, seed=i)
        for i in range(num)
    ]
    outputs = llm.generate([prompt] * num, params)
    counts = dict.fromkeys(expected, 0)
    for out in outputs:
        counts[tuple(out.outputs[0].token_ids[:2])] += 1
    spec = llm.engine.scheduler.speculator
    assert spec.num_drafts >= num // 2, spec.num_drafts
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    cells = list(expected)
    stat = chi_square([counts[c] for c in cells], [expected[c] for c in cells])
    assert stat < CHI2_001[15], (counts, expected, stat)
    assert_no_leak(llm.engine.block_manager)
