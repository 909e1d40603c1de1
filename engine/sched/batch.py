"""One scheduler step: the only contract between the scheduler and the runner.

For ``seqs[i]`` the runner computes ``token_ids[c : c + num_new_tokens[i]]`` with
``c = seqs[i].num_computed_tokens`` (read before ``postprocess`` advances it), writing K/V through
``seqs[i].block_table``. ``sample_seqs[j]`` gets one new token sampled from the logits of the last
token computed for ``seqs[sample_rows[j]]``; several sample seqs share a row when an ``n > 1``
prompt completes (its completions each sample their first token from the same logits).

    seqs:          [ A (decode, 1) | B (prefill chunk, 64) | C (last chunk, 17) ]
    sample_seqs:   [ A, C, C' , C'' ]       sample_rows: [0, 2, 2, 2]   (B is mid-prompt: no sample)

Speculation (engine/spec/): a decoding sequence with drafts d_1..d_k computes its one uncomputed token
followed by the drafts, ``num_new_tokens = 1 + k``; the drafts are not in its ``token_ids`` (only the
accepted ones get there, in ``postprocess``), and its sample takes all 1 + k positions' logits:

    positions:   c        c+1   ...  c+k
    input:     [ t_c    | d_1 | ... | d_k ]       KV written for all; kept for t_c and the accepted drafts
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # sequences computing tokens this step, in batch order
    num_new_tokens: list[int]  # per seq: tokens it computes this step (> 0)
    sample_seqs: list[Sequence]  # sequences that get one new token this step
    sample_rows: list[int]  # per sample seq: index into ``seqs`` whose last computed token's logits it samples
    block_copies: list[tuple[int, int]]  # (src, dst) whole-block copies to do before the step (copy-on-write)
    draft_token_ids: list[list[int]] = field(default_factory=list)  # per seq (or empty: none): its drafts

    def __post_init__(self) -> None:
        assert len(self.seqs) == len(self.num_new_tokens) > 0, "a batch computes at least one sequence"
        assert all(n > 0 for n in self.num_new_tokens), self.num_new_tokens
        assert len(self.sample_seqs) == len(self.sample_rows)
        assert all(0 <= r < len(self.seqs) for r in self.sample_rows), self.sample_rows
        if self.draft_token_ids:
            assert len(self.draft_token_ids) == len(self.seqs)
            assert all(not d or n == 1 + len(d) for d, n in zip(self.draft_token_ids, self.num_new_tokens))

    @property
    def has_drafts(self) -> bool:
        return any(self.draft_token_ids)

    def drafts_of(self, row: int) -> list[int]:
        return self.draft_token_ids[row] if self.draft_token_ids else []

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)
