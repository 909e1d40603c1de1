"""One scheduler step: the only contract between the scheduler and the runner.

For ``seqs[i]`` the runner computes ``token_ids[c : c + num_new_tokens[i]]`` with
``c = seqs[i].num_computed_tokens`` (read before ``postprocess`` advances it), writing K/V through
``seqs[i].block_table``. ``sample_seqs[j]`` gets one new token sampled from the logits of the last
token computed for ``seqs[sample_rows[j]]``; several sample seqs share a row when an ``n > 1``
prompt completes (its completions each sample their first token from the same logits).

    seqs:          [ A (decode, 1) | B (prefill chunk, 64) | C (last chunk, 17) ]
    sample_seqs:   [ A, C, C' , C'' ]       sample_rows: [0, 2, 2, 2]   (B is mid-prompt: no sample)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # sequences computing tokens this step, in batch order
    num_new_tokens: list[int]  # per seq: tokens it computes this step (> 0)
    sample_seqs: list[Sequence]  # sequences that get one new token this step
    sample_rows: list[int]  # per sample seq: index into ``seqs`` whose last computed token's logits it samples
    block_copies: list[tuple[int, int]]  # (src, dst) whole-block copies to do before the step (copy-on-write)

    def __post_init__(self) -> None:
        assert len(self.seqs) == len(self.num_new_tokens) > 0, "a batch computes at least one sequence"
        assert all(n > 0 for n in self.num_new_tokens), self.num_new_tokens
        assert len(self.sample_seqs) == len(self.sample_rows)
        assert all(0 <= r < len(self.seqs) for r in self.sample_rows), self.sample_rows

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)
