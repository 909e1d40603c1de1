"""Sampler: each filter against a hand-written reference, penalties against transformers, seeded
reproducibility across batch compositions, sampling frequencies against the filtered softmax."""

import math
import random
import re
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import (
    Sampler,
    TokenLogprobs,
    apply_min_p_,
    apply_penalties_,
    apply_top_k_top_p_,
    first_max_index,
)
from engine.sched.sequence import Sequence

NEG_INF = float("-inf")
# Chi-square critical values at p = 0.001, by degrees of freedom (standard table).
CHI2_CRIT_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def make_seq(prompt, outputs=(), stops=frozenset(), seq_id=0, **params):
    tokens = list(prompt) + list(outputs)
    return Sequence(
        seq_id=seq_id,
        token_ids=tokens,
        num_prompt_tokens=len(prompt),
        params=SamplingParams(**params),
        stop_token_ids=frozenset(stops),
    )


# ---- hand-written references: python loops over one row, no shared code with the sampler ----------


def ref_probs(row: list[float]) -> list[float]:
    m = max(x for x in row if x != NEG_INF)
    e = [math.exp(x - m) if x != NEG_INF else 0.0 for x in row]
    return [v / sum(e) for v in e]


def ref_top_k(row, k):
    if k <= 0:
        return list(row)
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x if x >= kth else NEG_INF for x in row]


def ref_top_p(row, p):
    if p >= 1.0:
        return list(row)
    probs = ref_probs(row)
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return [x if i in kept else NEG_INF for i, x in enumerate(row)]


def ref_min_p(row, min_p):
    probs = ref_probs(row)
    top = max(probs)
    return [x if probs[i] >= min_p * top else NEG_INF for i, x in enumerate(row)]


def ref_distribution(row, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's order: temperature, min-p, top-k, top-p."""
    row = [x / temperature for x in row]
    row = ref_top_p(ref_top_k(ref_min_p(row, min_p), top_k), top_p)
    return ref_probs(row)


def distinct_logits(rows, vocab, seed, scale=2.0):
    """Logits with no ties (a permutation of spread values per row), so every cut is unambiguous."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        vals = [scale * (i / vocab - 0.5) * 4 + rng.uniform(0, 0.01) for i in range(vocab)]
        rng.shuffle(vals)
        out.append(vals)
    return torch.tensor(out)


# ---- filters ---------------------------------------------------------------------------------------


def test_top_k_top_p_masks_match_reference():
    logits = distinct_logits(8, 12, seed=1)
    top_k = torch.tensor([0, 1, 3, 12, 50, 0, 4, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.8, 0.97])
    got = logits.clone()
    apply_top_k_top_p_(got, top_k, top_p)
    for r in range(8):
        want = ref_top_p(ref_top_k(logits[r].tolist(), int(top_k[r])), float(top_p[r]))
        assert got[r].tolist() == want, f"row {r}"


@pytest.mark.parametrize("vocab", [12, 1000])  # distinct logits, and a nearly flat row wider than the window
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(vocab):
    # 5e-324 is a valid top_p (a float64 > 0) but reads as 0.0 in float32: it used to keep nothing and
    # crash the decode worker on an index of -1 (found by the HTTP fuzzer).
    logits = (
        distinct_logits(2, vocab, seed=3)
        if vocab == 12
        else torch.zeros(2, vocab).index_fill_(1, torch.tensor([7]), 1e-3)
    )
    got = logits.clone()
    apply_top_k_top_p_(got, torch.tensor([0, 0]), torch.tensor([5e-324, 5e-324]))
    for r in range(2):
        assert torch.isfinite(got[r]).nonzero().flatten().tolist() == [int(logits[r].argmax())]


def test_top_p_beyond_the_window_falls_back_to_a_full_sort():
    # A flat 1000-token distribution: top_p = 0.6 keeps ~600 tokens, past the 256-token window.
    logits = distinct_logits(3, 1000, seed=2, scale=0.3)
    top_p = torch.tensor([0.6, 0.999, 0.05])
    got = logits.clone()
    apply_top_k_top_p_(got, torch.zeros(3, dtype=torch.long), top_p)
    for r in range(3):
        want = ref_top_p(logits[r].tolist(), float(top_p[r]))
        assert got[r].tolist() == want, f"row {r}"
    assert (got[0] > NEG_INF).sum() > 256


def test_min_p_mask_matches_reference():
    logits = distinct_logits(4, 16, seed=3)
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = logits.clone()
    apply_min_p_(got, min_p)
    for r in range(4):
        assert got[r].tolist() == ref_min_p(logits[r].tolist(), float(min_p[r])), f"row {r}"
    assert (got[3] > NEG_INF).sum() == 1  # min_p = 1 keeps only the most likely token


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    vocab = 40
    seqs = [
        make_seq([1, 5, 5, 9], [3, 9, 39], repetition_penalty=1.3),
        make_seq([2, 4], [], repetition_penalty=0.7),
        make_seq([7, 8], [8], repetition_penalty=1.0),  # off: the row must not change
    ]
    logits = torch.randn(3, vocab) * 3
    got = logits.clone()
    apply_penalties_(got, seqs)
    for r, seq in enumerate(seqs):
        proc = RepetitionPenaltyLogitsProcessor(penalty=seq.params.repetition_penalty)
        want = proc(torch.tensor([seq.token_ids]), logits[r : r + 1].clone())[0]
        torch.testing.assert_close(got[r], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_match_openai_formula():
    torch.manual_seed(1)
    vocab = 30
    seqs = [
        make_seq([4, 4, 6], [6, 6, 11, 29], presence_penalty=0.5, frequency_penalty=0.25),
        make_seq([1], [2, 2, 2], presence_penalty=-1.0, frequency_penalty=0.0),
        make_seq([3, 3], [], presence_penalty=2.0, frequency_penalty=2.0),  # no outputs: unchanged
        make_seq(
            [5], [5, 7], presence_penalty=0.0, frequency_penalty=-0.5, repetition_penalty=1.5
        ),  # repetition first, then frequency
    ]
    logits = torch.randn(4, vocab) * 2
    got = logits.clone()
    apply_penalties_(got, seqs)
    for r, seq in enumerate(seqs):
        want = logits[r].tolist()
        rp = seq.params.repetition_penalty
        for t in set(seq.token_ids):
            want[t] = want[t] * rp if want[t] < 0 else want[t] / rp
        for t, c in Counter(seq.output_token_ids).items():
            want[t] -= seq.params.frequency_penalty * c + seq.params.presence_penalty
        torch.testing.assert_close(got[r], torch.tensor(want), rtol=1e-6, atol=1e-6)


# ---- the sampler -------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(2)
    logits = torch.randn(6, 500)
    before = logits.clone()
    seqs = [make_seq([1], temperature=0.0, top_k=3, top_p=0.5) if r % 2 == 0 else make_seq([1]) for r in range(6)]
    out = Sampler(seed=0)(logits, seqs)
    want = logits.argmax(dim=1).tolist()
    assert [out.token_ids[r] for r in (0, 2, 4)] == [want[r] for r in (0, 2, 4)]
    assert torch.equal(logits, before)
    assert out.logprobs == [None] * 6


def test_greedy_rows_that_edit_their_logits_leave_the_input_untouched():
    # Only an all-plain greedy batch is read in place; penalties and min_tokens edit a private copy.
    torch.manual_seed(5)
    logits = torch.randn(3, 50)
    before = logits.clone()
    seqs = [
        make_seq([3, 3], [8], temperature=0.0, repetition_penalty=1.5),
        make_seq([1], [2, 2], temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        make_seq([1], [], stops={int(logits[2].argmax())}, temperature=0.0, min_tokens=1),
    ]
    out = Sampler(seed=0)(logits, seqs)
    assert torch.equal(logits, before)
    assert out.token_ids[2] == int(logits[2].topk(2).indices[1])  # the stop token was masked for this step


def test_greedy_large_batch():
    torch.manual_seed(3)
    logits = torch.randn(64, 32000)
    out = Sampler()(logits, [make_seq([1], temperature=0.0)] * 64)
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_first_max_index_breaks_ties_and_nan_like_argmax():
    # Greedy picks by max(dim=1); argmax's contract is the first index of the maximum, NaN counting as it.
    torch.manual_seed(4)
    ties = torch.randint(0, 20, (64, 32000)).float()  # every row holds its maximum many times
    expected = [int((row == row.max()).nonzero()[0]) for row in ties]
    assert first_max_index(ties).tolist() == expected
    special = torch.randn(3, 1000)
    special[0, [7, 900]] = float("nan")
    special[1, [5, 999]] = float("inf")
    special[2, :] = float("-inf")
    assert first_max_index(special).tolist() == [7, 5, 0] == special.argmax(dim=1).tolist()


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 10.0  # the stop token is by far the most likely
    logits[:, 2] = 5.0
    short = make_seq([1], [4], stops={7, 9}, temperature=0.0, min_tokens=2, max_tokens=5)
    done = make_seq([1], [4, 4], stops={7, 9}, temperature=0.0, min_tokens=2, max_tokens=5)
    sampled = make_seq([1], [], stops={7}, min_tokens=1)
    out = Sampler(seed=0)(logits, [short, done, sampled])
    assert out.token_ids[:2] == [2, 7]
    many = Sampler(seed=0)(logits[:1].expand(2000, 10), [sampled] * 2000)
    assert 7 not in many.token_ids


def test_logprobs_are_raw_log_softmax_with_ranked_top():
    torch.manual_seed(4)
    logits = torch.randn(4, 50) * 2
    seqs = [
        make_seq([3, 3], [8], logprobs=3, temperature=0.5, repetition_penalty=1.4, top_k=5),
        make_seq([1], logprobs=0, temperature=0.0),
        make_seq([1]),
        make_seq([1], logprobs=20, seed=5),
    ]
    out = Sampler(seed=0)(logits, seqs)
    ref = logits.log_softmax(dim=1)
    assert out.logprobs[2] is None
    for r, n in ((0, 3), (1, 0), (3, 20)):
        lp = out.logprobs[r]
        assert isinstance(lp, TokenLogprobs) and lp.token_id == out.token_ids[r]
        assert lp.logprob == pytest.approx(ref[r, lp.token_id].item(), abs=1e-6)
        vals, ids = ref[r].sort(descending=True)
        assert [t for t, _ in lp.top] == ids[:n].tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals[:n].tolist(), abs=1e-6)


def _run_steps(sampler, make_logits, steps, build_batch):
    """Samples `steps` tokens; build_batch(step) -> (seqs, row of the watched seq). Appends tokens."""
    tokens = []
    for step in range(steps):
        seqs, row = build_batch(step)
        out = sampler(make_logits(step, len(seqs), row), seqs)
        for seq, tok in zip(seqs, out.token_ids):
            seq.token_ids.append(tok)
        tokens.append(out.token_ids[row])
    return tokens


def test_seeded_tokens_do_not_depend_on_the_batch():
    vocab, steps = 200, 10
    watched_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]

    def logits_with(step, num_rows, row):
        batch = torch.randn(num_rows, vocab) * 3  # the neighbours' logits: anything
        batch[row] = watched_logits[step]
        return batch

    params = dict(seed=1234, top_p=0.95, temperature=0.9)
    alone = make_seq([1, 2], **params)
    tokens_alone = _run_steps(Sampler(), logits_with, steps, lambda s: ([alone], 0))

    together = make_seq([1, 2], **params)
    others = [
        make_seq([3], seed=7, seq_id=1),
        make_seq([4], seq_id=2, top_k=4),
        make_seq([5], seq_id=3, seed=99, min_p=0.1),
        make_seq([6], seq_id=4, temperature=0.0),
    ]
    rng = random.Random(0)

    def mixed(step):
        seqs = others[: 1 + step % len(others)] + [together]
        rng.shuffle(seqs)
        return seqs, seqs.index(together)

    tokens_mixed = _run_steps(Sampler(), logits_with, steps, mixed)
    assert tokens_alone == tokens_mixed

    other_seed = make_seq([1, 2], **{**params, "seed": 4321})
    assert _run_steps(Sampler(), logits_with, steps, lambda s: ([other_seed], 0)) != tokens_alone


def _chi_square(counts: Counter, probs: list[float], n: int) -> tuple[float, int]:
    assert all(probs[t] > 0 for t in counts), "sampled a filtered token"
    support = [i for i, p in enumerate(probs) if p > 0]
    stat = sum((counts.get(i, 0) - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    return stat, len(support) - 1


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.1, top_k=6, top_p=0.9),
    ],
)
def test_sampling_frequencies_match_filtered_softmax(params):
    row = [1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.0, 1.6]
    want = ref_distribution(row, **params)
    n = 20000
    seq = make_seq([1], **params)
    out = Sampler(seed=11)(torch.tensor([row]).expand(n, len(row)), [seq] * n)
    stat, dof = _chi_square(Counter(out.token_ids), want, n)
    assert stat < CHI2_CRIT_0001[dof], (stat, dof)


def test_seeded_rows_sample_the_right_distribution():
    row = [0.5, 1.5, -0.2, 1.0, 0.1]
    want = ref_distribution(row, temperature=1.0)
    n = 4000
    seqs = [make_seq([1], seed=s, seq_id=s) for s in range(n)]
    out = Sampler()(torch.tensor([row]).expand(n, len(row)), seqs)
    stat, dof = _chi_square(Counter(out.token_ids), want, n)
    assert stat < CHI2_CRIT_0001[dof], (stat, dof)
    assert all(isinstance(s.generator, torch.Generator) for s in seqs)


# ---- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_greedy_is_argmax_of_biased_logits_per_row():
    torch.manual_seed(6)
    logits = torch.randn(4, 300)
    before = logits.clone()
    top = logits.argmax(dim=1).tolist()
    biases = [{top[0]: -100.0}, {17: 100.0}, {}, {top[3]: -1.5, 250: 2.5, 3: 0.25}]
    seqs = [make_seq([1], temperature=0.0, logit_bias=b or None) for b in biases]
    out = Sampler(seed=0)(logits, seqs)
    expected = []
    for r, bias in enumerate(biases):  # the reference: bias added to a copy of the row, one entry at a time
        row = logits[r].tolist()
        for token_id, value in bias.items():
            row[token_id] += value
        expected.append(max(range(len(row)), key=row.__getitem__))
    assert out.token_ids == expected
    assert out.token_ids[1] == 17 and out.token_ids[0] != top[0] and out.token_ids[2] == top[2]
    assert torch.equal(logits, before)  # biased rows edit a private copy


def test_logit_bias_leaves_logprobs_raw():
    # vLLM's default: logprobs come from the model's logits, before any processing.
    torch.manual_seed(7)
    logits = torch.randn(1, 40)
    out = Sampler(seed=0)(logits, [make_seq([1], temperature=0.0, logprobs=2, logit_bias={5: 100.0})])
    assert out.token_ids == [5]
    assert out.logprobs[0].logprob == pytest.approx(logits.log_softmax(dim=1)[0, 5].item(), abs=1e-6)


def test_logit_bias_sampling_frequencies_match_biased_softmax():
    row = [1.2, 0.3, -0.5, 2.0, 0.9]
    bias = {3: -2.0, 1: 1.5}
    want = ref_distribution([x + bias.get(i, 0.0) for i, x in enumerate(row)], temperature=0.8)
    n = 20000
    seq = make_seq([1], temperature=0.8, logit_bias=bias)
    out = Sampler(seed=12)(torch.tensor([row]).expand(n, len(row)), [seq] * n)
    stat, dof = _chi_square(Counter(out.token_ids), want, n)
    assert stat < CHI2_CRIT_0001[dof], (stat, dof)


def test_logit_bias_id_past_the_logits_is_skipped_not_fatal():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    out = Sampler(seed=0)(logits, [make_seq([1], temperature=0.0, logit_bias={2: 1.0, 99: 100.0})])
    assert out.token_ids == [2]


@pytest.mark.parametrize(
    "bias, message",
    [
        ({3: 100.5}, "logit_bias must be a map of non-negative token ids to biases in [-100, 100]"),
        ({-1: 1.0}, "logit_bias must be"),
        ({3: float("nan")}, "logit_bias must be"),
        ({True: 1.0}, "logit_bias must be"),
    ],
)
def test_logit_bias_out_of_range_names_the_parameter(bias, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


def test_allowed_token_ids_greedy_is_the_argmax_over_the_allowed_and_logprobs_stay_raw():
    torch.manual_seed(8)
    logits = torch.randn(3, 300)
    before = logits.clone()
    allowed = [[5, 9, 17], None, [logits[2].argmax().item(), 250]]
    seqs = [make_seq([1], temperature=0.0, allowed_token_ids=a, logprobs=1) for a in allowed]
    out = Sampler(seed=0)(logits, seqs)
    expected = [max(a or range(300), key=lambda t: logits[r, t].item()) for r, a in enumerate(allowed)]
    assert out.token_ids == expected and out.token_ids[1] == logits[1].argmax().item()
    raw = logits.log_softmax(dim=1)
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(
        [raw[r, t].item() for r, t in enumerate(expected)], abs=1e-6
    )
    assert torch.equal(logits, before)  # the mask edits a private copy


def test_allowed_token_ids_sampling_frequencies_match_the_softmax_over_the_allowed():
    row = [1.2, 0.3, -0.5, 2.0, 0.9, 3.0]
    allowed = [0, 2, 4]
    want = ref_distribution([x if i in allowed else NEG_INF for i, x in enumerate(row)], temperature=0.8)
    n = 20000
    seq = make_seq([1], temperature=0.8, allowed_token_ids=allowed)
    out = Sampler(seed=13)(torch.tensor([row]).expand(n, len(row)), [seq] * n)
    assert set(out.token_ids) <= set(allowed)
    stat, dof = _chi_square(Counter(out.token_ids), want, n)
    assert stat < CHI2_CRIT_0001[dof], (stat, dof)


@pytest.mark.parametrize("allowed", [[], [-1], [True]])
def test_allowed_token_ids_must_name_token_ids(allowed):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=allowed)


def test_a_seeded_stream_continues_after_a_first_token_sampled_elsewhere():
    from engine.sampling.sampler import continue_seeded_stream

    torch.manual_seed(9)
    steps = torch.randn(2, 1, 50)
    alone = make_seq([1], temperature=1.0, seed=42)  # one engine samples both tokens
    first, second = (Sampler(seed=0)(steps[i], [alone]).token_ids[0] for i in range(2))
    elsewhere = Sampler(seed=0)(steps[0], [make_seq([1], temperature=1.0, seed=42)]).token_ids[0]
    assert elsewhere == first  # the prefill worker: a fresh generator of the same seed
    resumed = make_seq([1], temperature=1.0, seed=42)  # the decode worker's own sequence
    continue_seeded_stream(resumed, 50, torch.device("cpu"))
    assert Sampler(seed=0)(steps[1], [resumed]).token_ids[0] == second
    greedy = make_seq([1], temperature=0.0, seed=42)
    continue_seeded_stream(greedy, 50, torch.device("cpu"))
    assert greedy.generator is None  # a greedy first token drew nothing


@pytest.mark.parametrize("ignore_eos, expected", [(False, {3, 7, 2, 9}), (True, {3, 7})])
def test_stop_ids_are_the_requests_stops_plus_eos_unless_ignored(ignore_eos, expected):
    params = SamplingParams(stop_token_ids=[3, 7, 3], ignore_eos=ignore_eos)
    assert params.stop_ids([2, 9]) == frozenset(expected)
