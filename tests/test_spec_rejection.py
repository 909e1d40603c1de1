"""The pieces of speculative decoding on their own: the n-gram proposer's exact proposals, the
``--speculative-config`` parser's refusals, and the rejection sampler keeping the target distribution
(chi-square against the exact distribution, fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from engine.spec.config import SpeculativeConfigError, parse_speculative_config
from engine.spec.ngram import NgramProposer
from engine.spec.rejection import verify_greedy, verify_sampled
from tests.spec_harness import CHI2_001, chi_square


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]
    # the 3-gram (8, 2, 3) does not recur; the 2-gram (2, 3) last occurred at 6, followed by 7 8 2
    assert proposer.propose(tokens, max_tokens=10) == [7, 8, 2]
    assert proposer.propose(tokens, max_tokens=2) == [7, 8]
    assert proposer.propose(tokens, max_tokens=0) == []
    assert proposer.propose([5, 6, 7, 8], max_tokens=4) == []  # nothing recurs
    assert NgramProposer(3, 3, 2).propose([1, 2, 9, 4, 2], max_tokens=4) == []  # only a 1-gram recurs
    assert NgramProposer(3, 3, 1).propose([1, 2, 9, 4, 2], max_tokens=4) == [9, 4, 2]
    # A match may overlap the suffix: a repeated token proposes its own run.
    assert NgramProposer(4, 2, 1).propose([7, 7, 7], max_tokens=9) == [7]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min=3"),
        ('{"method": "ngram", "k": 2}', "unknown keys ['k']"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be int"),
        ('{"method": "draft_model"}', '"model"'),
    ],
)
def test_speculative_config_refusals_name_the_key(text: str, needle: str) -> None:
    with pytest.raises(SpeculativeConfigError) as info:
        parse_speculative_config(text)
    assert needle in str(info.value)


def test_speculative_config_as_vllm_takes_it() -> None:
    assert parse_speculative_config("") is None
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == ("ngram", 5, 3, 1)


def test_greedy_verification_accepts_the_agreeing_prefix() -> None:
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]).accepted == [4, 5, 6]
    v = verify_greedy([4, 5, 6, 7], [4, 9, 6])
    assert (v.accepted, v.token) == ([4], 5)
    v = verify_greedy([4, 5], [3])
    assert (v.accepted, v.token) == ([], 4)


def _first_token_counts(p: torch.Tensor, draft_sampler, num: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    counts = [0] * p.shape[1]
    for _ in range(num):
        drafts, draft_probs = draft_sampler(gen)
        verdict = verify_sampled(p, drafts, gen, draft_probs)
        emitted = verdict.accepted + [verdict.token]
        counts[emitted[0]] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Drafts from a distribution q far from p (and from a point mass on p's least likely token): the
    first emitted token must be distributed as p_0."""
    p = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])  # p_0, p_1 over V = 5
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]])  # q_0

    def from_q(gen):
        return [int(torch.multinomial(q[0], 1, generator=gen))], q

    def point_mass(gen):
        return [0], None

    for sampler, seed in ((from_q, 1), (point_mass, 2)):
        counts = _first_token_counts(p, sampler, 8000, seed)
        stat = chi_square(counts, p[0].tolist())
        assert stat < CHI2_001[4], (sampler.__name__, counts, stat)


def test_rejection_sampling_accepts_when_draft_equals_target() -> None:
    # q == p: every draft is accepted (u * q(d) < p(d) for u < 1), the emitted tokens are the drafts + a bonus.
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        d = int(torch.multinomial(p[0], 1, generator=gen))
        verdict = verify_sampled(p, [d], gen, p[:1])
        assert (verdict.accepted, verdict.token) == ([d], 2)


def test_back_off_waits_double_after_each_poor_probe_and_reset_on_acceptance() -> None:
    from engine.sampling.params import SamplingParams
    from engine.sched.sequence import Sequence
    from engine.spec.config import SpeculativeConfig
    from engine.spec.speculator import FIRST_BACKOFF, Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, min_acceptance=0.5))
    seq = Sequence(0, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100))

    def steps_until_proposal() -> int:
        for waited in range(1000):
            if spec.propose([seq], num_running=1, limits=[49])[0]:
                return waited
        raise AssertionError("never proposes")

    assert steps_until_proposal() == 0  # hopeful at first: proposes [3, 1]
    spec.record(seq, 2, 0)  # 1.0 -> 0.7: still above 0.5, no wait
    assert steps_until_proposal() == 0
    spec.record(seq, 2, 0)  # 0.49: below -> wait 4
    assert steps_until_proposal() == FIRST_BACKOFF
    spec.record(seq, 2, 0)  # still low -> wait 8
    assert steps_until_proposal() == 2 * FIRST_BACKOFF
    spec.record(seq, 2, 2)  # a good probe lifts the average above 0.5: back to every step
    spec.record(seq, 2, 2)
    assert seq.spec.acceptance >= 0.5 and steps_until_proposal() == 0
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (5, 10, 4)
    assert spec.num_accepted_per_pos == [2, 2]
    # Past max_num_seqs running sequences nobody speculates.
    assert spec.propose([seq], num_running=spec.config.max_num_seqs + 1, limits=[49]) == [[]]
