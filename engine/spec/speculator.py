"""Who speculates this step, and with which drafts: the proposer behind a back-off.

A sequence gets drafts only when
- fewer than ``max_num_seqs`` sequences run (a full batch already fills each weight pass: verifying
  drafts there costs compute and buys no bandwidth);
- its sampling is position-independent beyond what verification reproduces: no grammar, no logprobs,
  no penalties (they read the tokens before each position), past ``min_tokens``, one completion;
- it is not backing off. A sequence whose acceptance average falls below ``min_acceptance``, or below
  the break-even of the cost model (engine/spec/draft_length.py: higher the more sequences decode),
  skips proposing for a while, then probes once more; each probe that leaves the average low doubles
  the wait (``FIRST_BACKOFF`` steps, at most ``MAX_BACKOFF``), so free text pays a verification on a few
  percent of its steps, and text that starts copying later is still caught.

How many drafts: the cost model's best length for the sequence's acceptance average, up to
``num_speculative_tokens`` (long while a copy keeps being accepted, short after rejections), as
llama.cpp's lookup drafts up to 16 and more on a long match. The average is per token: a step's
accepted drafts over the drafts it decided (the accepted ones and the first rejected one).
"""

from __future__ import annotations

from typing import Protocol

from engine.sched.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_length import break_even, draft_length
from engine.spec.ngram import NgramProposer

EWMA_WEIGHT = 0.3  # weight of the latest step in a sequence's acceptance average
FIRST_BACKOFF = 4  # steps a sequence waits after its average first falls below min_acceptance
MAX_BACKOFF = 128  # the longest wait: one probe in 128 steps costs well under 1% at a 1.5x step


class Proposer(Protocol):
    """Where drafts come from: prompt lookup (engine/spec/ngram.py) or a draft model (engine/spec/draft.py)."""

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` drafts for ``seqs[i]``, all sequences at once; sets each one's
        ``spec.draft_probs``."""

    def release(self, seq: Sequence) -> None:
        """Drop what is held for ``seq`` (it finished, was aborted or preempted)."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        """``proposer``: None makes the n-gram proposer of ``config`` (method "ngram")."""
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"method {config.method!r} needs its proposer")
            proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
        self.config = config
        self.proposer = proposer
        # vLLM's spec_decode counters, all time: read by the worker's /metrics
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * config.num_speculative_tokens
        self._floor = config.min_acceptance  # the acceptance below which record() backs a sequence off

    def propose(self, seqs: list[Sequence], num_running: int, limits: list[int]) -> list[list[int]]:
        """Drafts for each of ``seqs``' next step (possibly none). ``limits[i]``: drafts ``seqs[i]`` may
        take at most (tokens it may still append and the step may still compute, less the one token the
        step emits of its own)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        cfg = self.config
        if num_running > cfg.max_num_seqs:
            return drafts
        rows = max(1, len(seqs))
        self._floor = max(cfg.min_acceptance, break_even(cfg.verify_row_cost, rows))
        chosen = [i for i, seq in enumerate(seqs) if limits[i] > 0 and eligible(seq) and not _waits(seq)]
        if chosen:
            k_max, cost = cfg.num_speculative_tokens, cfg.verify_row_cost
            lengths = [min(draft_length(seqs[i].spec.acceptance, k_max, cost, rows), limits[i]) for i in chosen]
            proposed = self.proposer.propose_batch([seqs[i] for i in chosen], lengths)
            for i, d in zip(chosen, proposed):
                drafts[i] = d
        return drafts

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Count one verification of ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        state = seq.spec
        state.num_drafts += 1
        state.num_draft_tokens += num_drafts
        state.num_accepted_tokens += num_accepted
        decided = num_accepted + (num_accepted < num_drafts)  # the accepted drafts and the first rejected one
        state.acceptance += EWMA_WEIGHT * (num_accepted / decided - state.acceptance)
        if state.acceptance < self._floor:
            state.backoff = min(MAX_BACKOFF, 2 * state.backoff) if state.backoff else FIRST_BACKOFF
            state.num_wait_steps = state.backoff
        else:
            state.backoff = 0
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_per_pos[pos] += 1


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return (
        seq.guide is None
        and p.n == 1
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and seq.num_output_tokens >= p.min_tokens
    )


def _waits(seq: Sequence) -> bool:
    # The back-off: count down the steps this sequence still sits out.
    state = seq.spec
    if state.num_wait_steps > 0:
        state.num_wait_steps -= 1
        return True
    return False
