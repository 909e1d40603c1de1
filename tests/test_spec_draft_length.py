"""Adaptive draft length and the cost-model back-off (engine/spec/draft_length.py, speculator.py): the
decisions from given acceptance averages and batch sizes, and greedy output with lengths up to 16
equal to plain decoding's, token for token, on every family."""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.sched.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_length import break_even, draft_length, expected_accepted, step_cost
from engine.spec.speculator import FIRST_BACKOFF, Speculator
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.spec_harness import FAMILIES, GREEDY, plain_output


def best_by_enumeration(acceptance: float, max_k: int, row_cost: float, rows: int) -> int:
    # The tokens per unit of cost of each length, written out term by term.
    def rate(k: int) -> float:
        accepted = sum(acceptance**i for i in range(1, k + 1))
        return (rows + accepted) / (1 + row_cost * (rows - 1 + k))

    rates = [rate(k) for k in range(1, max_k + 1)]
    return 1 + rates.index(max(rates))


def test_expected_accepted_and_costs() -> None:
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 7) == 7.0
    assert expected_accepted(0.0, 5) == 0.0
    assert step_cost(17, 0.0625) == pytest.approx(2.0)
    # One row decoding: drafting pays above a = row_cost; sixteen: above 16 c / (1 + 15 c).
    assert break_even(0.08, 1) == pytest.approx(0.08)
    assert break_even(0.08, 16) == pytest.approx(1.28 / 2.2)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99, 1.0])
def test_draft_length_maximises_tokens_per_cost(acceptance: float, rows: int) -> None:
    assert draft_length(acceptance, 16, 0.08, rows) == best_by_enumeration(acceptance, 16, 0.08, rows)


def test_draft_length_grows_with_acceptance() -> None:
    lengths = [draft_length(a / 100, 16, 0.08, 1) for a in range(0, 101, 5)]
    assert lengths == sorted(lengths)
    assert lengths[0] == 1 and lengths[-1] == 16  # nothing accepted: one probe draft; a perfect copy: all 16
    assert draft_length(0.9, 16, 0.08, 1) > 4 > draft_length(0.5, 16, 0.08, 1)
    assert draft_length(0.9, 16, 0.0, 1) == 16  # no cost: as long as allowed


def test_back_off_from_the_cost_model_depends_on_the_batch() -> None:
    """The same acceptance average, 0.21 (above min_acceptance 0.2 and above one decoding sequence's
    break-even 0.08, below four's 0.32 / 1.24), backs a sequence off among four, not alone."""
    config = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=2, min_acceptance=0.2)
    for rows, backs_off in ((1, False), (4, True)):
        spec = Speculator(config)
        seqs = [
            Sequence(i, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100)) for i in range(rows)
        ]
        # hopeful at first: all 8 allowed, cut to what follows the match of "1 2"
        assert spec.propose(seqs, num_running=rows, limits=[50] * rows)[0] == [3, 1, 2]
        seqs[0].spec.acceptance = 0.3
        spec.record(seqs[0], 2, 0)  # 0.3 + 0.3 (0 - 0.3)
        assert seqs[0].spec.acceptance == pytest.approx(0.21)
        assert (seqs[0].spec.num_wait_steps == FIRST_BACKOFF) is backs_off
        assert seqs[0].spec.num_wait_steps in (0, FIRST_BACKOFF)


def test_acceptance_average_is_per_decided_draft() -> None:
    # 2 of 4 accepted: 3 drafts were decided (2 accepted, the third rejected), the rest never looked at.
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.0, verify_row_cost=0.0))
    seq = Sequence(0, [1, 2, 1, 2], SamplingParams(temperature=0.0, max_tokens=100))
    seq.spec.acceptance = 0.0
    spec.record(seq, 4, 2)
    assert seq.spec.acceptance == pytest.approx(0.3 * 2 / 3)
    spec.record(seq, 4, 4)  # all accepted: a rate of 1
    assert seq.spec.acceptance == pytest.approx(0.2 + 0.3 * 0.8)


def spec_config(k: int) -> str:
    # min_acceptance 0: the back-off never stops the drafts here; the default verify cost picks the lengths.
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "min_acceptance": 0.0})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_with_adaptive_lengths_equals_plain_decoding(family: str) -> None:
    prompts, expected = plain_output(family, 8)
    llm = LLM(str(tiny_model_dir(family)), block_size=8, kv_cache_memory_mb=8, speculative_config=spec_config(16))
    lengths: list[int] = []
    propose = llm.engine.scheduler.speculator.proposer.propose_batch

    def recorded(seqs, limits):
        # the lengths the cost model chose, where the request's remaining tokens did not cut them
        lengths.extend(n for s, n in zip(seqs, limits) if n < s.params.max_tokens - s.num_output_tokens - 1)
        return propose(seqs, limits)

    llm.engine.scheduler.speculator.proposer.propose_batch = recorded
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} diverges at token {next(j for j in range(len(e)) if g[j] != e[j])}"
    spec = llm.engine.scheduler.speculator
    assert spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens < spec.num_draft_tokens, "no draft was rejected: the rollback is untested"
    assert max(lengths) > 4 and min(lengths) < 4, sorted(set(lengths))  # the length adapted both ways
    assert_no_leak(llm.engine.block_manager)
    follow = prompts[0] + expected[0][:20]
    again = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == expected[0][20:40]
    assert_no_leak(llm.engine.block_manager)
