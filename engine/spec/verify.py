"""One step's sampling when some of its sequences carry drafts: every plain sample as the sampler does
it, every speculating sequence's 1 + k positions verified (engine/spec/rejection.py).

Rows of ``hidden`` the logits are taken from, for a batch of plain A and speculating B (k = 2):

    hidden rows:   | A: t | B: t_c d_1 d_2 |
    logits rows:   [ A's last | B's p_0 p_1 p_2 ]     plain rows first, then each speculating block
"""

from __future__ import annotations

import itertools

import torch

from engine.sampling.sampler import Sampler, SamplerOutput, first_max_index
from engine.sched.batch import ScheduledBatch
from engine.spec.rejection import Verdict, verify_greedy, verify_sampled


def sample_with_drafts(compute_logits, hidden: torch.Tensor, batch: ScheduledBatch, sampler: Sampler) -> SamplerOutput:
    """``compute_logits``: the model's norm + LM head; ``hidden`` [num_tokens, hidden] of the step."""
    ends = list(itertools.accumulate(batch.num_new_tokens))  # 1 past each seq's last new token
    plain, spec = [], []
    for j, row in enumerate(batch.sample_rows):
        (spec if batch.drafts_of(row) else plain).append(j)
    rows = [ends[batch.sample_rows[j]] - 1 for j in plain]
    for j in spec:
        row = batch.sample_rows[j]
        rows += range(ends[row] - batch.num_new_tokens[row], ends[row])
    logits = compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])  # [len(rows), V]

    token_ids = [0] * len(batch.sample_seqs)
    logprobs: list = [None] * len(batch.sample_seqs)
    accepted: list[list[int]] = [[] for _ in batch.sample_seqs]
    if plain:
        out = sampler(logits[: len(plain)], [batch.sample_seqs[j] for j in plain])
        for j, token, lp in zip(plain, out.token_ids, out.logprobs):
            token_ids[j], logprobs[j] = token, lp
    offset = len(plain)
    for j in spec:
        drafts = batch.drafts_of(batch.sample_rows[j])
        block = logits[offset : offset + len(drafts) + 1]  # [1 + k, V]: p_0 .. p_k
        offset += len(drafts) + 1
        verdict = _verify(block, batch.sample_seqs[j], drafts, sampler)
        token_ids[j], accepted[j] = verdict.token, verdict.accepted
    return SamplerOutput(token_ids, logprobs, accepted)


def _verify(block: torch.Tensor, seq, drafts: list[int], sampler: Sampler) -> Verdict:
    target = sampler.target_distribution(block, seq)
    if sampler.is_greedy(seq):
        return verify_greedy(first_max_index(target).tolist(), drafts)
    q = seq.spec.draft_probs  # a draft model's q_0..q_{k'-1} (k' >= k: the scheduler may cut drafts); None: point mass
    q = None if q is None else q[: len(drafts)].to(target.device)
    return verify_sampled(target, drafts, sampler.generator_for(seq, block.device), q)
