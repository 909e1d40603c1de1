"""Speculative decoding through the engine: greedy output with n-gram speculation equals the output
without it, token for token, on every family; under continuous batching with speculating and plain
sequences, and with preemption; the prefix cache never holds a block with a rejected draft; sampled
output keeps the target distribution (chi-square against the exact distribution from transformers).
Every scenario ends with the leak check."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from protocol.hashing import block_hashes
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.spec_harness import (
    FAMILIES,
    GREEDY,
    assert_greedy_equal_with_rejections,
    assert_sampled_pairs_keep_the_distribution,
    plain_output,
    spec_config,
)


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
    assert_greedy_equal_with_rejections(llm, got, expected)
    spec = llm.engine.scheduler.speculator
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


def test_sampled_speculation_keeps_the_target_distribution() -> None:
    """The first two sampled tokens' joint frequencies over many seeded requests match the exact joint
    distribution (chi-square, alpha 0.001); every pair of allowed tokens occurs in the prompt, so the
    second token (the first a decode step verifies drafts for) always comes with drafts."""
    llm = LLM(
        str(tiny_model_dir("llama")),
        block_size=8,
        kv_cache_memory_mb=16,
        max_num_seqs=256,
        speculative_config=spec_config(k=3, lookup_max=2, max_num_seqs=256),
    )
    assert_sampled_pairs_keep_the_distribution(llm, "llama", 2400)
    assert_no_leak(llm.engine.block_manager)
