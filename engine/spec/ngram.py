"""Prompt-lookup (n-gram) proposals, as vLLM's ``method: "ngram"``.

The last n tokens of a sequence (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked
up in the sequence's own earlier tokens (prompt and output); the tokens that followed the most recent
earlier occurrence are the proposal:

    token_ids:  ... a b c X Y Z W ... a b c |        suffix "a b c" found earlier;
                          ^^^^^^^ proposed next: X Y Z W (k = 4)

The draft distribution of such a proposal is a point mass on each proposed token.
"""

from __future__ import annotations

from engine.sched.sequence import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        assert 1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens >= 1
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` tokens that followed the latest earlier match of the longest
        matching suffix; empty when no suffix of ``min_n`` tokens or more recurs."""
        k = min(self.k, max_tokens)
        total = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = token_ids[total - n :]
            first = suffix[0]
            # Latest match first: recent text is the likelier continuation. A match must end before the
            # suffix itself starts, so at least one token follows it.
            for start in range(total - n - 1, -1, -1):
                if token_ids[start] == first and token_ids[start : start + n] == suffix:
                    return token_ids[start + n : start + n + k]
        return []

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """``propose`` for each sequence (the proposer interface engine/spec/speculator.py calls). A lookup
        is a point-mass draft: no draft distribution is kept (``seq.spec.draft_probs`` stays None)."""
        for seq in seqs:
            seq.spec.draft_probs = None
        return [self.propose(seq.token_ids, limit) for seq, limit in zip(seqs, limits)]

    def release(self, seq: Sequence) -> None:
        """Nothing is held per sequence."""
