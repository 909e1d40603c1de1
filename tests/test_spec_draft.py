"""Draft-model speculation (engine/spec/draft.py): a random draft checkpoint of the same vocabulary and the
target's own first layer ("self:1") as drafts. Greedy output equals plain decoding token for token on
every family; sampled output keeps the target's distribution (chi-square); both pools end with no block
held; a draft of another vocabulary is refused at start."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from configs.schema import EX_CONFIG, ConfigError
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.invariants import assert_no_leak
from tests.model_factory import _root, tiny_model_dir
from tests.spec_harness import (
    FAMILIES,
    GREEDY,
    assert_greedy_equal_with_rejections,
    assert_sampled_pairs_keep_the_distribution,
    copy_prompts,
    plain_output,
)

# The draft's weight noise, relative to each weight's spread: enough that it disagrees with the target
# on some of the test's tokens (tiny random qwen3 repeats its tokens: a mild noise agreed on every one).
NOISE = {"llama": 0.5, "mistral": 0.5, "qwen2": 0.5, "qwen3": 1.5}


def draft_config(model: str, k: int = 3, max_num_seqs: int = 64) -> str:
    # min_acceptance 0 and no verify cost: every step drafts, so rejections (and the rollback of the draft's
    # KV) happen.
    return json.dumps(
        {
            "method": "draft_model",
            "model": model,
            "num_speculative_tokens": k,
            "max_num_seqs": max_num_seqs,
            "min_acceptance": 0.0,
            "verify_row_cost": 0.0,
        }
    )


@functools.cache
def random_draft(family: str) -> str:
    """The target's checkpoint with random noise on every weight: the tokenizer and vocabulary of the
    target, and a next-token choice that agrees with it often but not always (another random
    checkpoint would agree almost never, leaving acceptance untested)."""
    source = tiny_model_dir(family)
    out = _root() / f"{family}-tiny-noisy"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * NOISE[family] * param.std())
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return str(out)


def assert_pools_idle(llm: LLM) -> None:
    spec = llm.engine.scheduler.speculator
    assert spec.proposer.num_shadows == 0, "a finished request left its draft state behind"
    assert_no_leak(llm.engine.block_manager)
    assert_no_leak(spec.proposer.block_manager)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft", ["random", "self:1"])
def test_greedy_draft_speculation_equals_plain_decoding(family: str, draft: str) -> None:
    target = str(tiny_model_dir(family))
    prompts, expected = plain_output(family, 8)
    if (family, draft) == ("qwen3", "self:1"):
        # Tiny random qwen3's greedy output repeats one token, which its first layer alone already
        # predicts: nothing would be rejected. The noisy checkpoint's output varies, and its first layer
        # disagrees with it at least once on these prompts.
        target = random_draft(family)
        plain = LLM(target, block_size=8, kv_cache_memory_mb=8)
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    model = random_draft(family) if draft == "random" else draft
    llm = LLM(target, block_size=8, kv_cache_memory_mb=8, speculative_config=draft_config(model))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert_greedy_equal_with_rejections(llm, got, expected)
    spec = llm.engine.scheduler.speculator
    assert_pools_idle(llm)
    # The draft's prefix cache serves a request continuing a finished one; its output still agrees.
    follow = prompts[0] + expected[0][:20]
    again = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == expected[0][20:40]
    assert spec.proposer.block_manager.num_prefix_hit_tokens > 0, "the draft's prefix cache was never hit"
    assert_pools_idle(llm)


def test_draft_speculation_with_preemption_and_plain_neighbours() -> None:
    """A pool so small that sequences are preempted (their draft state released) and recomputed, beside
    sequences that cannot speculate: each output equals its plain run alone."""
    family = "llama"
    prompts = [p for p in copy_prompts(seed=3) if len(p) < 200]
    plain_only = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    params = [plain_only if i == 1 else GREEDY for i in range(len(prompts))]
    plain = LLM(str(tiny_model_dir(family)), block_size=8, kv_cache_memory_mb=8)
    alone = [plain.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(
        str(tiny_model_dir(family)),
        block_size=8,
        num_kv_blocks=40,
        enable_prefix_caching=False,
        speculative_config=draft_config(random_draft(family)),
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == alone
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert llm.engine.scheduler.speculator.num_accepted_tokens > 0
    assert_pools_idle(llm)


@pytest.mark.parametrize("draft", ["random", "self:1"])
def test_sampled_draft_speculation_keeps_the_target_distribution(draft: str) -> None:
    """The first two sampled tokens' joint frequencies over many seeded requests against the exact joint
    distribution of the target (chi-square, alpha 0.001); the second token is always verified with a
    draft drawn from the draft model's own distribution."""
    family = "llama"
    model = random_draft(family) if draft == "random" else draft
    llm = LLM(
        str(tiny_model_dir(family)),
        block_size=8,
        kv_cache_memory_mb=16,
        max_num_seqs=256,
        speculative_config=draft_config(model, k=2, max_num_seqs=256),
    )
    assert_sampled_pairs_keep_the_distribution(llm, family, 1600)
    assert_pools_idle(llm)


@functools.cache
def other_vocabulary_draft() -> str:
    """A random llama checkpoint with 800 token rows: not the target's 768."""
    out = _root() / "llama-tiny-vocab800"
    source = Path(random_draft("llama"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.resize_token_embeddings(800)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return str(out)


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path) -> None:
    draft = other_vocabulary_draft()
    line = (
        f"draft model {draft!r} has a vocabulary of 800 tokens, the target 768: a draft must share the target's "
        "tokenizer"
    )
    with pytest.raises(ConfigError) as refused:
        LLM(str(tiny_model_dir("llama")), speculative_config=draft_config(draft))
    assert str(refused.value) == line
    with pytest.raises(ConfigError, match=r"'self:2': N must be an integer in 1\.\.1 \(the target has 2 layers\)"):
        LLM(str(tiny_model_dir("llama")), speculative_config=draft_config("self:2"))
    config = tmp_path / "spec.yaml"
    config.write_text(f"engine:\n  speculative_config: '{draft_config(draft)}'\n")
    argv = [sys.executable, "-m", "cluster", "generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hi"]
    done = subprocess.run([*argv, "--config", str(config)], capture_output=True, text=True, timeout=300)
    assert done.returncode == EX_CONFIG, done.stderr
    assert line in done.stderr
    assert len([x for x in done.stderr.splitlines() if "vocabulary" in x]) == 1, done.stderr
