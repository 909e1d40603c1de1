"""Picks one token per row of a batch of logits, each row under its own request's SamplingParams.

Order of operations on a row (vLLM v1's order):

    raw logits ─▶ structured outputs: tokens the request's grammar refuses set to -inf
      ─▶ logprobs: log_softmax of these RAW logits (vLLM's default), for requests that ask
      ─▶ allowed_token_ids: every other token set to -inf ─▶ logit_bias added ─▶ min_tokens: stop tokens masked
      ─▶ repetition penalty (HF) ─▶ presence/frequency (OpenAI)
      ─▶ greedy rows take the argmax here
      ─▶ temperature ─▶ min-p ─▶ top-k ─▶ top-p ─▶ softmax ─▶ exponential race

Every step is one masked op on the whole [S, V] batch; only the seeded rows' noise draw loops.

Exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is token i with probability p_i
(the Gumbel-max trick in another form). The noise is per row, so a seeded row draws its noise from its
own generator and its token depends on its logits and its generator only, never on the batch around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from engine.sampling.structured_output import apply_grammars_
from engine.sched.sequence import Sequence

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow the logits.
_GREEDY_EPS = 1e-5
# Top-p first looks for its cut among this many most likely tokens (see apply_top_k_top_p_).
_TOP_P_WINDOW = 256


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model distribution
    top: list[tuple[int, float]]  # (token, logprob) of the params.logprobs most likely, most likely first
    rank: int = 0  # the token's rank, 1 = most likely (0: not computed)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row of the logits
    logprobs: list[TokenLogprobs | None]  # one per row; None where the request asked for none
    accepted: list[list[int]] | None = None  # speculation: per row, the accepted drafts before its token


class Sampler:
    """Stateless but for the generator shared by unseeded requests (seeded ones own theirs)."""

    def __init__(self, seed: int | None = None):
        self._seed = seed  # seeds the shared generator; None: a fresh nondeterministic seed
        self._shared: torch.Generator | None = None  # created on first use, on the logits' device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), "one logits row per sequence"
        raw = logits.float()  # [S, V]; left untouched for logprobs once grammars have masked it
        if raw is logits and any(s.guide is not None for s in seqs):
            raw = raw.clone()  # the grammars' masks must not reach the caller's logits
        only_stop = apply_grammars_(raw, seqs)  # no-op without a grammar
        # Processed in place below: a copy only when some row gets edited, so neither the caller's
        # logits nor the raw values logprobs read ever change (an all-greedy batch edits nothing).
        x = raw.clone() if any(_edits_logits(s) for s in seqs) else raw  # [S, V]
        apply_allowed_tokens_(x, seqs)
        apply_logit_bias_(x, seqs)
        apply_min_tokens_(x, seqs, except_rows=only_stop)
        apply_penalties_(x, seqs)
        tokens = first_max_index(x)  # [S]; final for greedy rows

        sampled = [i for i, s in enumerate(seqs) if s.params.temperature >= _GREEDY_EPS]
        if sampled:
            every_row = len(sampled) == len(seqs)
            rows = torch.tensor(sampled, dtype=torch.long, device=x.device)
            sub = x if every_row else x[rows]  # [R, V]
            params = [seqs[i].params for i in sampled]
            _apply_filters_(sub, params)
            probs = sub.softmax(dim=1)  # [R, V]; filtered tokens get exactly 0
            chosen = self._exponential_race(probs, [seqs[i] for i in sampled])  # [R]
            tokens = chosen if every_row else tokens.index_copy(0, rows, chosen)

        token_ids = tokens.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(raw, seqs, token_ids))

    def target_distribution(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distribution ``seq`` samples from at each row of ``logits`` [R, V] (every row one position
        of this one sequence): for a greedy request its processed logits (their argmax is the token), else
        the probabilities after its filters. For requests ``engine.spec.speculator.eligible`` admits: no
        grammar, penalty or pending min_tokens, whose edits would differ by position."""
        x = logits.float().clone()  # [R, V]
        rows = [seq] * x.shape[0]
        apply_allowed_tokens_(x, rows)
        apply_logit_bias_(x, rows)
        if seq.params.temperature < _GREEDY_EPS:
            return x
        _apply_filters_(x, [seq.params] * x.shape[0])
        return x.softmax(dim=1)

    def generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """The generator ``seq``'s random draws come from: its own when seeded, else the shared one."""
        return _generator_of(seq, device) if seq.params.seed is not None else self._shared_generator(device)

    @staticmethod
    def is_greedy(seq: Sequence) -> bool:
        return seq.params.temperature < _GREEDY_EPS

    def _exponential_race(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        num_rows, vocab = probs.shape
        noise = torch.empty_like(probs)  # [R, V], uniform in [0, 1) until the log below
        seeded = [r for r, s in enumerate(seqs) if s.params.seed is not None]
        if len(seeded) < num_rows:
            shared = self._shared_generator(probs.device)
            if not seeded:
                noise.uniform_(generator=shared)
            else:
                unseeded = [r for r in range(num_rows) if seqs[r].params.seed is None]
                draw = torch.rand(len(unseeded), vocab, device=probs.device, generator=shared)
                noise[torch.tensor(unseeded, dtype=torch.long, device=probs.device)] = draw
        for r in seeded:
            # A fresh [V] draw each time: the row's noise must not depend on where it sits in the batch.
            own = _generator_of(seqs[r], probs.device)
            noise[r] = torch.rand(vocab, device=probs.device, generator=own)
        # q = -log(u) ~ Exp(1); ~10x cheaper than exponential_() on CPU. u = 0 gives q = inf, so a
        # score p / q is 0 (never NaN); u < 1 keeps q > 0.
        noise.log_().neg_()
        return first_max_index(probs.div_(noise))

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._shared is None or self._shared.device != device:
            self._shared = torch.Generator(device=device)
            if self._seed is None:
                self._shared.seed()
            else:
                self._shared.manual_seed(self._seed)
        return self._shared


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)``: the first index of each row's maximum (NaN counting as the maximum, as in
    argmax). ``max(dim=1)`` gives the same indices ~2.7x faster on CPU (torch 2.13: 0.94 vs 2.60 ms on
    [64, 32000], one thread), which is 2% of a decode step at batch 64."""
    return x.max(dim=1).indices


def _edits_logits(seq: Sequence) -> bool:
    """Whether min_tokens, a penalty or the filters of a sampled (non-greedy) row may edit its logits."""
    p = seq.params
    return (
        p.temperature >= _GREEDY_EPS
        or seq.num_output_tokens < p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
    )


def continue_seeded_stream(seq: Sequence, vocab: int, device: torch.device) -> None:
    """For a seeded sequence whose first token was sampled elsewhere (the prefill worker, from a fresh
    generator of the same seed): advance its own generator past that draw, so that the tokens it samples
    next are the ones one engine would have sampled. Greedy tokens draw nothing."""
    if seq.params.seed is not None and seq.params.temperature >= _GREEDY_EPS:
        torch.rand(vocab, device=device, generator=_generator_of(seq, device))


def _generator_of(seq: Sequence, device: torch.device) -> torch.Generator:
    """The request's own generator, created from params.seed on its first sampled token."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return seq.generator


def apply_allowed_tokens_(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Sets (in place) every token outside a request's allowed_token_ids to -inf in its row. Ids >= V
    are skipped (admission refuses them: engine.sequence.vocab_error)."""
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        allowed = seq.params.allowed_token_ids
        if allowed is not None:
            keep = torch.ones(vocab, dtype=torch.bool, device=logits.device)
            keep[[t for t in allowed if t < vocab]] = False
            logits[i].masked_fill_(keep, float("-inf"))


def apply_logit_bias_(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Adds (in place) each request's logit_bias to its row. Requests are admitted only with ids < V
    (engine.sequence.vocab_error); ids >= V are skipped all the same, as one must not fail the batch."""
    vocab = logits.shape[1]
    rows, cols, biases = [], [], []
    for i, seq in enumerate(seqs):
        for token_id, bias in (seq.params.logit_bias or {}).items():
            if token_id < vocab:
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
    if rows:
        logits[rows, cols] += logits.new_tensor(biases)


def apply_min_tokens_(logits: torch.Tensor, seqs: list[Sequence], except_rows: set[int] = frozenset()) -> None:
    """Masks (in place) the stop tokens of every sequence with fewer than min_tokens outputs, but for
    ``except_rows``: those whose grammar has ended and allows nothing else."""
    vocab = logits.shape[1]
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens and i not in except_rows:
            stops = [t for t in seq.stop_token_ids if t < vocab]
            rows += [i] * len(stops)
            cols += stops
    if rows:
        logits[rows, cols] = float("-inf")


def apply_penalties_(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Applies (in place) the repetition penalty, then the presence and frequency penalties.

    repetition (HF): over prompt and output tokens, a positive logit is divided by the penalty and a
    negative one multiplied. presence/frequency (OpenAI): over output tokens,
    logit -= frequency * count + presence * (count > 0).
    Only the (row, token) entries that occur are touched: a few hundred per row, not V.
    """
    vocab = logits.shape[1]
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        rows, ids = _occurrences(rep, [seqs[i].token_ids for i in rep], vocab, logits.device)  # [N] both
        penalty = logits.new_tensor([s.params.repetition_penalty for s in seqs])[rows]  # [N]
        seen = logits[rows, ids]  # [N]; a repeated token writes the same value each time
        logits[rows, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    occ = [
        i
        for i, s in enumerate(seqs)
        if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0) and s.num_output_tokens
    ]
    if occ:
        rows, ids = _occurrences(occ, [seqs[i].output_token_ids for i in occ], vocab, logits.device)  # [N]
        frequency = logits.new_tensor([s.params.frequency_penalty for s in seqs])  # [S]
        presence = logits.new_tensor([s.params.presence_penalty for s in seqs])  # [S]
        flat = logits.view(-1)  # [S * V]
        flat.index_put_((rows * vocab + ids,), -frequency[rows], accumulate=True)  # once per occurrence
        present = torch.unique(rows * vocab + ids)  # [U]; once per distinct (row, token)
        flat.index_put_((present,), -presence[present // vocab], accumulate=True)


def _occurrences(
    row_ids: list[int], token_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N], ids [N]) long: one entry per token of each list, tagged with its row; ids >= V dropped."""
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long, device=device), lengths)
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    keep = ids < vocab
    return rows[keep], ids[keep]


def _apply_filters_(logits: torch.Tensor, params: list) -> None:
    """Temperature, min-p, top-k and top-p on the rows of sampled (non-greedy) requests, in place."""
    temperature = logits.new_tensor([p.temperature for p in params]).unsqueeze(1)  # [R, 1]
    logits.div_(temperature)
    if any(p.min_p > 0.0 for p in params):
        apply_min_p_(logits, logits.new_tensor([p.min_p for p in params]))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=logits.device)
        apply_top_k_top_p_(logits, top_k, logits.new_tensor([p.top_p for p in params]))


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops (in place) tokens with p < min_p * p_max; min_p [R], 0 keeps every token.

    Done on logits: p_i / p_max = exp(l_i - l_max), so the test is l_i < l_max + log(min_p).
    """
    floor = logits.amax(dim=1, keepdim=True) + min_p.log().unsqueeze(1)  # [R, 1]; log(0) = -inf
    logits.masked_fill_(logits < floor, float("-inf"))


def apply_top_k_top_p_(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keeps (in place) the top_k most likely tokens, then the fewest whose mass reaches top_p.

    top_k [R] long, 0 = off; top_p [R] float, 1 = off. Top-p is taken on the distribution that top-k
    left and always keeps the most likely token; tokens tied with the last one kept are kept too.
    A full [R, V] sort costs ~1 ms a row on CPU, so the cut is first looked for among the few most
    likely tokens (where it lies for a peaked distribution); only rows whose window runs out are sorted.
    """
    vocab = logits.shape[1]
    use_k, use_p = top_k > 0, top_p < 1.0  # [R] both
    if not bool((use_k | use_p).any()):
        return
    k = torch.where(use_k, top_k.clamp(max=vocab), vocab)  # [R]
    window = min(vocab, max(_TOP_P_WINDOW if bool(use_p.any()) else 1, int(k[use_k].max()) if bool(use_k.any()) else 1))
    ranked = logits.topk(window, dim=1).values  # [R, W], most likely first; W >= every top_k in use
    ranks = torch.arange(window, device=logits.device)  # [W]
    ranked.masked_fill_(ranks >= k.unsqueeze(1), float("-inf"))  # top-k
    # Log-normaliser of what top-k left: all of it lies in the window when top-k is on.
    log_z = ranked.logsumexp(dim=1)  # [R]
    if not bool(use_k.all()):
        log_z = torch.where(use_k, log_z, logits.logsumexp(dim=1))
    log_z = log_z.unsqueeze(1)  # [R, 1]
    probs = (ranked - log_z).exp()  # [R, W]
    mass_before = probs.cumsum(dim=1) - probs  # [R, W]; mass of the more likely tokens, exactly 0 at rank 0
    limit = torch.where(use_p, top_p, float("inf")).unsqueeze(1)  # [R, 1]; rounding never cuts when off
    # rank 0 always: a top_p below float32's smallest number (5e-324 is a valid float64) reads as 0 here
    keep = ((mass_before < limit) | (ranks == 0)) & (ranked > float("-inf"))  # [R, W], a prefix of the ranks
    floor = ranked.gather(1, (keep.sum(dim=1) - 1).unsqueeze(1))  # [R, 1]; the least likely token kept
    floor.masked_fill_(~(use_k | use_p).unsqueeze(1), float("-inf"))
    short = use_p & ~use_k & keep[:, -1] if window < vocab else torch.zeros_like(use_p)  # [R]
    if bool(short.any()):
        floor[short] = _top_p_floor_sorted(logits[short], top_p[short])
    logits.masked_fill_(logits < floor, float("-inf"))


def _top_p_floor_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n, 1]: the least likely logit that top-p keeps, found by a full sort of each row."""
    ranked = logits.sort(dim=1, descending=True).values  # [n, V]
    probs = ranked.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # [n, V]
    num_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=1)  # [n] >= 1
    return ranked.gather(1, (num_keep - 1).unsqueeze(1))


def _logprobs(raw: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprobs | None]:
    """The sampled token's raw log-probability and the top-N, for the rows whose request asks."""
    asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if not asked:
        return out
    idx = torch.tensor(asked, dtype=torch.long, device=raw.device)
    targets = torch.tensor([token_ids[i] for i in asked], device=raw.device)
    entries = token_logprobs(raw[idx], targets, max(seqs[i].params.logprobs for i in asked))
    for i, entry in zip(asked, entries):
        del entry.top[seqs[i].params.logprobs :]
        out[i] = entry
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Per row of ``logits`` [R, V]: the log-probability and rank of ``targets`` [R] and the ``num_top``
    most likely tokens, under log_softmax of the raw logits."""
    lp = logits.float().log_softmax(dim=1)  # [R, V]
    chosen = lp.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (lp > chosen).sum(dim=1) + 1  # [R]: 1 + tokens strictly more likely
    top_lp, top_ids = lp.topk(num_top, dim=1)  # [R, num_top], most likely first (num_top may be 0)
    return [
        TokenLogprobs(t, c, list(zip(ids, lps)), r)
        for t, c, ids, lps, r in zip(
            targets.tolist(), chosen.squeeze(1).tolist(), top_ids.tolist(), top_lp.tolist(), ranks.tolist()
        )
    ]
