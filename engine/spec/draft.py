"""Draft-model proposals, as vLLM's ``method: "draft_model"``: a smaller model of the target's tokenizer
(or the target's own first layers, engine/spec/draft_model.py) drafts k tokens autoregressively, each
pass batched over every drafting sequence, on its own paged KV (its own block manager and pool).

Each target sequence has a shadow Sequence in the draft's block manager, same id and tokens:

    target token_ids:  [ confirmed (prompt, outputs) ................................... ]
    shadow token_ids:  [ confirmed ............. | d_1 .. d_{k-1} of the last proposal ]
    shadow computed:   |------ kept ------|-- rolled back: the rejected drafts' slots, overwritten --|

One proposal for a batch of sequences:
1. sync: a shadow's computed tokens are cut to the prefix it shares with the target's tokens (and to
   one short of them: the last token is computed again for its logits); blocks past that are freed; its
   tokens become the target's. A new shadow takes what the draft's prefix cache holds of its prompt.
2. catch up: one pass computes every shadow's uncomputed tokens (its whole prompt the first time; after
   that the accepted drafts and the target's own token) and draws d_1 from each last position.
3. up to k - 1 passes of one token per shadow still drafting: d_i computed, d_{i+1} drawn.
Full blocks go to the draft's prefix cache only while a shadow holds confirmed tokens alone (after step 2,
and on release after cutting the drafts off), so a cached draft block never holds a guessed token.

A draft is drawn from the request's own distribution on the draft's logits (its temperature, top-k/p,
bias): greedy requests take the argmax, sampled ones a draw whose q_i is kept in ``seq.spec.draft_probs``
for the rejection sampler (engine/spec/rejection.py).
"""

from __future__ import annotations

import torch

from engine.kv.block_manager import BlockManager
from engine.sampling.sampler import Sampler, first_max_index
from engine.sched.batch import ScheduledBatch
from engine.sched.sequence import Sequence, SequenceStatus
from engine.step.runner import ModelRunner


class DraftProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, sampler: Sampler):
        """``runner``: the draft model over its own pool; ``block_manager``: that pool's blocks;
        ``sampler``: the target's (the request's filters and generator)."""
        self.runner = runner
        self.block_manager = block_manager
        self.sampler = sampler
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow (holds draft blocks)
        self._num_confirmed: dict[int, int] = {}  # target seq_id -> the shadow's leading tokens that are the target's

    @property
    def num_shadows(self) -> int:
        return len(self._shadows)

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, seq in enumerate(seqs) if self._sync(seq)]
        if not active:
            return drafts
        shadows = [self._shadows[seqs[i].seq_id] for i in active]
        logits = self._run(shadows, [s.num_uncomputed_tokens for s in shadows])  # [len(active), V]
        for shadow in shadows:
            self.block_manager.cache_full_blocks(shadow)  # confirmed tokens only, all computed now
        while True:
            for row, i in enumerate(active):
                token, q = self._draw(logits[row : row + 1], seqs[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(drafts[i]) < limits[i] and self._extend(seqs[i])]
            if not active:
                break
            shadows = [self._shadows[seqs[i].seq_id] for i in active]
            for shadow, i in zip(shadows, active):
                shadow.token_ids.append(drafts[i][-1])
            logits = self._run(shadows, [1] * len(shadows))
        for seq, q in zip(seqs, probs):
            seq.spec.draft_probs = torch.cat(q) if q else None
        return drafts

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is None:
            return
        confirmed = self._num_confirmed.pop(seq.seq_id)
        self._cut(shadow, confirmed)  # deallocate caches full blocks: none may hold a draft
        self.block_manager.deallocate(shadow)

    def _sync(self, seq: Sequence) -> bool:
        """Make ``seq``'s shadow hold its tokens, computed as far as they agree, with blocks for the
        rest; False (and no shadow) when the draft's pool has no room."""
        bm = self.block_manager
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, list(seq.token_ids), seq.params, status=SequenceStatus.RUNNING)
            _, hit_tokens = bm.prefix_hit(shadow)
            if not bm.can_allocate(shadow, shadow.num_tokens - hit_tokens):
                return False
            copies = bm.allocate(shadow, shadow.num_tokens - hit_tokens)  # a cache hit covers whole blocks
        else:
            agree = _common_prefix(shadow.token_ids, seq.token_ids, shadow.num_computed_tokens)
            self._cut(shadow, min(agree, seq.num_tokens - 1))
            shadow.token_ids = list(seq.token_ids)
            if not bm.can_allocate(shadow, shadow.num_uncomputed_tokens):
                self.release(seq)
                return False
            # Never a copy-on-write: the cut keeps every cached (shareable) block whole.
            copies = bm.allocate(shadow, shadow.num_uncomputed_tokens)
        assert not copies, "a shadow writes into a shared (cached) block"
        self._shadows[seq.seq_id] = shadow
        self._num_confirmed[seq.seq_id] = seq.num_tokens
        return True

    def _cut(self, shadow: Sequence, num_tokens: int) -> None:
        # Forget the shadow's tokens (and KV) from ``num_tokens`` on: their blocks go back, unhashed.
        del shadow.token_ids[max(num_tokens, 1) :]
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, num_tokens)
        self.block_manager.free_unused_tail(shadow)

    def _extend(self, seq: Sequence) -> bool:
        """Room for one more draft token in ``seq``'s shadow (allocated now); False: it stops drafting."""
        shadow, bm = self._shadows[seq.seq_id], self.block_manager
        if not bm.can_allocate(shadow, 1):
            return False
        copies = bm.allocate(shadow, 1)
        assert not copies, "a shadow writes into a shared (cached) block"
        return True

    def _run(self, shadows: list[Sequence], counts: list[int]) -> torch.Tensor:
        """One draft pass computing ``counts[i]`` tokens of ``shadows[i]`` (their blocks allocated); the
        logits of each one's last token."""
        rows = list(range(len(shadows)))
        logits = self.runner.execute_logits(ScheduledBatch(shadows, counts, shadows, rows, []))
        for shadow, n in zip(shadows, counts):
            shadow.num_computed_tokens += n
        return logits

    def _draw(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        """The next draft for ``seq`` from the draft's ``logits`` [1, V], and q (None for greedy)."""
        dist = self.sampler.target_distribution(logits, seq)  # [1, V]
        if self.sampler.is_greedy(seq):
            return int(first_max_index(dist)[0]), None
        generator = self.sampler.generator_for(seq, dist.device)
        return int(torch.multinomial(dist[0], 1, generator=generator)), dist


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
