"""What the speculative-decoding tests share (test_spec_*.py): the n-gram config that verifies every
proposal, prompts that make lookups find proposals, plain decoding's output as the reference, the
greedy comparison against it, and the sampled check: the first two tokens' frequencies over many
seeded requests against the exact joint distribution from transformers (chi-square)."""

from __future__ import annotations

import functools
import json

import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.model_factory import tiny_model_dir

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ALLOWED = [11, 12, 13, 14]  # a tiny vocabulary: the exact distribution has 16 cells over two tokens
# Every pair (t0, t1) of ALLOWED tokens occurs in it, so the second token (the first a decode step
# verifies drafts for) always comes with drafts.
PAIRS_PROMPT = [5, 11, 11, 12, 11, 13, 11, 14, 12, 12, 13, 12, 14, 13, 13, 14, 14, 11, 5]
# Chi-square critical values at alpha = 0.001 (the test fails by chance once in a thousand seeds).
CHI2_001 = {4: 18.467, 15: 37.697}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


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


def assert_greedy_equal_with_rejections(llm: LLM, got: list[list[int]], expected: list[list[int]]) -> None:
    """``got`` (``llm``'s speculating output) is ``expected`` token for token, and the run both accepted
    and rejected drafts: what the comparison is worth."""
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} diverges at token {next(j for j in range(len(e)) if g[j] != e[j])}"
    spec = llm.engine.scheduler.speculator
    assert spec.num_accepted_tokens > 0, "no draft was accepted: the test exercises nothing"
    assert spec.num_accepted_tokens < spec.num_draft_tokens, "no draft was rejected: the rollback is untested"


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


def assert_sampled_pairs_keep_the_distribution(llm: LLM, family: str, num: int) -> None:
    """``num`` seeded requests of PAIRS_PROMPT on ``llm`` (speculating, of ``family``'s tiny model), each
    sampling 3 tokens over ALLOWED: most drew drafts, some were rejected, and the first two tokens'
    frequencies match the exact joint distribution (chi-square, alpha 0.001)."""
    expected = exact_two_token_distribution(family, PAIRS_PROMPT)
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=ALLOWED, seed=i)
        for i in range(num)
    ]
    outputs = llm.generate([PAIRS_PROMPT] * num, params)
    counts = dict.fromkeys(expected, 0)
    for out in outputs:
        counts[tuple(out.outputs[0].token_ids[:2])] += 1
    spec = llm.engine.scheduler.speculator
    assert spec.num_drafts >= num // 2, spec.num_drafts
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    cells = list(expected)
    stat = chi_square([counts[c] for c in cells], [expected[c] for c in cells])
    assert stat < CHI2_001[15], (counts, expected, stat)
