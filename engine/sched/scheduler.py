"""Continuous batching under a per-step token budget, with chunked prefill and preemption by recompute.

One step (``schedule``), in this order:
1. Decodes: every running sequence with one uncomputed token gets it (admission order). When blocks
   run out, the most recently admitted running sequence is preempted: its blocks are released (full
   ones stay in the prefix cache) and it goes back to the front of the waiting queue with
   ``num_computed_tokens = 0``; its generated tokens are kept and recomputed with the prompt.
2. Prefill chunks of running sequences still catching up, then new admissions from the waiting queue
   (front first, prefix cache hit first): each chunk at most ``prefill_chunk_size`` tokens, the batch
   at most ``max_num_batched_tokens``, at most ``max_num_seqs`` running sequences.
   With a speculator (engine/spec/), a decoding sequence may compute its token plus k draft tokens as
   one chunk; without room for them it decodes plainly.
3. ``postprocess`` advances computed tokens (for a speculating sequence only up to its accepted drafts;
   blocks that hold only rejected drafts are freed), caches newly full blocks, appends sampled tokens, checks
   stops and frees the finished sequences' blocks.

``n > 1``: when a prompt's last chunk is scheduled, its n - 1 extra completions are forked from it
(shared blocks, copy-on-write). They get negative seq ids (-1, -2, ...) so they cannot collide with
callers' ids (which must be >= 0); ``request_id_of``/``completion_index_of`` map them back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager, cdiv
from engine.sched.batch import ScheduledBatch
from engine.sched.sequence import Sequence, SequenceStatus
from engine.spec.speculator import Speculator

log = logging.getLogger(__name__)


class AdmissionError(ValueError):
    """A sequence this scheduler can never run; the message names the limit and the value."""


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 8192  # tokens computed per step at most
    max_model_len: int = 8192  # prompt + generated tokens at most
    prefill_chunk_size: int = 512  # prompt tokens of one sequence per step at most

    def __post_init__(self) -> None:
        assert min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, self.prefill_chunk_size) > 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, speculator: Speculator | None = None):
        """``speculator``: proposes draft tokens for decoding sequences; None: no speculation."""
        self.config = config
        self.block_manager = block_manager
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self._live: dict[int, Sequence] = {}  # every unfinished sequence, waiting or running
        self._origin: dict[int, tuple[int, int]] = {}  # child seq_id -> (parent seq_id, completion index)
        self._children: dict[int, list[int]] = {}  # parent seq_id -> child seq ids
        self._finished_last_call: list[int] = []  # forgotten at the next postprocess/abort
        self._child_ids = itertools.count(-1, -1)
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def request_id_of(self, seq: Sequence) -> int:
        """The caller's seq id of the request ``seq`` belongs to (valid until the next postprocess)."""
        return self._origin.get(seq.seq_id, (seq.seq_id, 0))[0]

    def completion_index_of(self, seq: Sequence) -> int:
        """Which of its request's n completions ``seq`` is: 0 for the caller's own sequence."""
        return self._origin.get(seq.seq_id, (seq.seq_id, 0))[1]

    # ---- admission and abort ----
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise AdmissionError for one that could never run."""
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq

    def add_prefilled(self, seq: Sequence) -> bool:
        """Admit a sequence whose prompt KV is already in its blocks (written by a prefill worker)
        straight into the running batch. Returns True when it finished at once (its first token, taken
        from the prefill worker, is a stop or its last): then its blocks are already released.

            token_ids: [ KV in the pool (num_computed_tokens) ....... | 1 uncomputed ]
            n == 1: the uncomputed token is the prefill worker's first token (already appended);
            n > 1:  it is the last prompt token; the next step computes it and forks the completions.
        """
        self.check_admissible(seq)
        assert seq.block_table and seq.num_uncomputed_tokens == 1, (len(seq.block_table), seq.num_uncomputed_tokens)
        seq.status = SequenceStatus.RUNNING
        self._live[seq.seq_id] = seq
        if seq.num_output_tokens:
            status = self._stop_status(seq, seq.token_ids[-1])
            if status is not None:
                self._finish(seq, status)
                return True
        self.running.append(seq)
        return False

    def check_admissible(self, seq: Sequence) -> None:
        """Raise AdmissionError for a sequence this scheduler could never run (or ValueError for a bad id)."""
        cfg, bm = self.config, self.block_manager
        if seq.seq_id < 0 or seq.seq_id in self._live or seq.seq_id in self._children:
            raise ValueError(f"seq_id {seq.seq_id} must be >= 0 and not in use")
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise AdmissionError(
                f"prompt has {seq.num_prompt_tokens} tokens; this model's context is {cfg.max_model_len} "
                "and at least one token must be generated"
            )
        if seq.params.n > cfg.max_num_seqs:
            raise AdmissionError(f"n={seq.params.n} completions exceed max_num_seqs={cfg.max_num_seqs}")
        # The last sampled token is never computed, so a sequence of L tokens needs KV for L - 1.
        max_len = min(seq.num_prompt_tokens + seq.params.max_tokens, cfg.max_model_len)
        capacity = bm.num_blocks * bm.block_size
        if cdiv(max_len - 1, bm.block_size) > bm.num_blocks:
            raise AdmissionError(
                f"sequence needs KV for {max_len - 1} tokens (prompt + max_tokens); the KV pool holds {capacity} tokens"
            )

    def abort(self, seq_id: int) -> list[Sequence]:
        """Abort a sequence and its forked completions at any phase; returns those that were live."""
        self._forget_finished()
        aborted = []
        for sid in [seq_id, *self._children.get(seq_id, [])]:
            seq = self._live.get(sid)
            if seq is None:
                continue
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            aborted.append(seq)
        return aborted

    # ---- one step ----
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        step = _StepBuilder(self.config.max_num_batched_tokens)
        self._schedule_decodes(step)
        self._schedule_running_prefills(step)
        self._admit_waiting(step)
        if not step.seqs:
            return None
        drafts = step.drafts if any(step.drafts) else []
        return ScheduledBatch(step.seqs, step.num_new_tokens, step.sample_seqs, step.sample_rows, step.copies, drafts)

    def _schedule_decodes(self, step: _StepBuilder) -> None:
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        proposals = self._drafts(decoding, step)  # one call: a draft model runs its passes batched
        for seq, drafts in zip(decoding, proposals):
            if seq.status != SequenceStatus.RUNNING or step.budget == 0:
                continue  # preempted by an earlier sequence of this loop
            drafts = drafts[: step.budget - 1]
            if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
                drafts = []  # no room for the drafts' KV: decode plainly rather than preempt for a guess
            while not self.block_manager.can_allocate(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._add_to_step(step, seq, 1 + len(drafts), drafts)

    def _drafts(self, decoding: list[Sequence], step: _StepBuilder) -> list[list[int]]:
        if self.speculator is None or not decoding:
            return [[] for _ in decoding]
        # Each may take what the step's budget leaves after one token for every decoding sequence.
        spare = step.budget - len(decoding)
        cfg = self.config
        limits = [
            min(s.params.max_tokens - s.num_output_tokens, cfg.max_model_len - s.num_tokens, spare + 1) - 1
            for s in decoding
        ]
        return self.speculator.propose(decoding, len(self.running), limits)

    def _schedule_running_prefills(self, step: _StepBuilder) -> None:
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if seq.status != SequenceStatus.RUNNING:
                continue
            if step.budget == 0:
                return
            n = min(seq.num_uncomputed_tokens, self.config.prefill_chunk_size, step.budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                # Only sequences not yet in this batch can give their blocks back; else wait a step.
                if victim in step.seqs or (victim is seq and step.seqs):
                    return
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._add_to_step(step, seq, n)

    def _admit_waiting(self, step: _StepBuilder) -> None:
        bm = self.block_manager
        while self.waiting and step.budget > 0:
            seq = self.waiting[0]
            if self._num_slots() + self._slots(seq) > self.config.max_num_seqs:
                return
            _, hit_tokens = bm.prefix_hit(seq)
            n = min(seq.num_tokens - hit_tokens, self.config.prefill_chunk_size, step.budget)
            if not bm.can_allocate(seq, n):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_step(step, seq, n)

    def _add_to_step(self, step: _StepBuilder, seq: Sequence, n: int, drafts: list[int] = ()) -> None:
        # seq's own allocation (prefix hit on first admission) happens here; n counts past the hit.
        step.copies += self.block_manager.allocate(seq, n)
        row = len(step.seqs)
        step.seqs.append(seq)
        step.num_new_tokens.append(n)
        step.drafts.append(list(drafts))
        step.budget -= n
        if seq.num_computed_tokens + n - len(drafts) < seq.num_tokens:
            return  # mid-prompt chunk: nothing to sample yet
        step.sample_seqs.append(seq)
        step.sample_rows.append(row)
        if self._will_fork(seq):
            for child in self._fork(seq):
                step.sample_seqs.append(child)
                step.sample_rows.append(row)

    def _will_fork(self, seq: Sequence) -> bool:
        # Children have negative ids; a parent forks once, even if preempted and recomputed later.
        return seq.params.n > 1 and seq.seq_id >= 0 and seq.seq_id not in self._children

    def _slots(self, seq: Sequence) -> int:
        # A prompt that will fork n completions reserves all n running slots up front.
        return seq.params.n if self._will_fork(seq) else 1

    def _num_slots(self) -> int:
        return sum(self._slots(s) for s in self.running)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        # Children share the parent's table; their num_computed_tokens catches up in postprocess,
        # once the step has written the prompt's KV.
        children = []
        for index in range(1, parent.params.n):
            # A seeded request's completions differ yet stay reproducible: completion i uses seed + i.
            params = parent.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + index)
            child = Sequence(
                next(self._child_ids),
                list(parent.token_ids),
                params,
                stop_token_ids=parent.stop_token_ids,
                num_prompt_tokens=parent.num_prompt_tokens,
                status=SequenceStatus.RUNNING,
                guide=None if parent.guide is None else parent.guide.fork(),
            )
            self.block_manager.fork(parent, child)
            self._origin[child.seq_id] = (parent.seq_id, index)
            self._children.setdefault(parent.seq_id, []).append(child.seq_id)
            self._live[child.seq_id] = child
            self.running.append(child)
            children.append(child)
        return children

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)  # full blocks stay cached: the recompute is mostly hits
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the step ----
    def postprocess(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: list | None,
        accepted: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """Apply a computed step; returns the sequences that finished in it. ``accepted``: per sample seq,
        the drafts verification accepted (they come before its ``token_ids`` entry); None: no drafts."""
        assert len(token_ids) == len(batch.sample_seqs), (len(token_ids), len(batch.sample_seqs))
        self._forget_finished()
        bm = self.block_manager
        accepted_by_row = {row: acc for row, acc in zip(batch.sample_rows, accepted)} if accepted else {}
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.is_finished:  # aborted after schedule: its blocks are gone already
                continue
            drafts = batch.drafts_of(row)
            if drafts:
                # KV of the rejected drafts stays in its slots until overwritten; it is not computed.
                # Its full blocks are offered to the cache once the accepted drafts are in token_ids.
                num_accepted = len(accepted_by_row[row])
                seq.num_computed_tokens += n - (len(drafts) - num_accepted)
                bm.free_unused_tail(seq)
                self.speculator.record(seq, len(drafts), num_accepted)
                continue
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
        for seq, row in zip(batch.sample_seqs, batch.sample_rows):
            source = batch.seqs[row]
            if source is not seq and not seq.is_finished:
                # A child forked this step: the prompt KV it shares is written now. (Before any
                # sequence finishes below: a finished parent's counters are reset.)
                seq.num_computed_tokens = source.num_computed_tokens
        finished = []
        for j, (seq, token) in enumerate(zip(batch.sample_seqs, token_ids)):
            if seq.is_finished:
                continue
            if batch.drafts_of(batch.sample_rows[j]) and self._append_accepted(seq, accepted[j]):
                finished.append(seq)
                continue
            if seq.guide is not None and not seq.guide.accept(token):
                # Unreachable while the sampler masks what the grammar refuses: a bug, not the request's.
                log.error("seq %d: sampled token %d is outside its grammar; stopping it", seq.seq_id, token)
                self.running.remove(seq)
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
                finished.append(seq)
                continue
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            status = self._stop_status(seq, token)
            if status is not None:
                self.running.remove(seq)
                self._finish(seq, status)
                finished.append(seq)
        return finished

    def _append_accepted(self, seq: Sequence, drafts: list[int]) -> bool:
        # Accepted drafts are output tokens like any other: each is checked for a stop, and what follows
        # a stop is dropped, as plain decoding would never have produced it. True: seq finished.
        for token in drafts:
            seq.token_ids.append(token)
            status = self._stop_status(seq, token)
            if status is not None:
                seq.num_computed_tokens = seq.num_tokens - 1  # the KV past the stop is of dropped tokens
                self.running.remove(seq)
                self._finish(seq, status)
                return True
        self.block_manager.cache_full_blocks(seq)  # num_computed_tokens == num_tokens now
        return False

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        # Stop tokens count only after min_tokens earlier outputs (the sampler masks them until then).
        if token in seq.stop_token_ids and seq.num_output_tokens - 1 >= seq.params.min_tokens:
            return SequenceStatus.FINISHED_STOPPED
        if seq.guide is not None and seq.guide.is_ended:  # the grammar took its stop token
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.block_manager.deallocate(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = status
        del self._live[seq.seq_id]
        self._finished_last_call.append(seq.seq_id)

    def _forget_finished(self) -> None:
        # Drop family bookkeeping of requests with no live sequence left, one call after they finished.
        for sid in self._finished_last_call:
            parent = self._origin.get(sid, (sid, 0))[0]
            family = [parent, *self._children.get(parent, [])]
            if not any(s in self._live for s in family):
                for s in family:
                    self._origin.pop(s, None)
                self._children.pop(parent, None)
        self._finished_last_call.clear()


@dataclass(slots=True)
class _StepBuilder:
    budget: int  # tokens left in this step
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per seq: its draft tokens (most empty)
