"""Scheduler: token budget, chunking, decode-first order, preemption, abort, n > 1 and stop rules.

A fake model keeps "KV" in a simulated paged pool: the value of position p mixes the value of p - 1,
read back through the block table, with token p; the next token depends on every context slot, read
through the block table. A wrong block table, a missed copy-on-write or a bad prefix hit changes the
outputs, which are checked against a pool-free reference.
"""

import pytest

from engine.kv.block_manager import BlockManager
from engine.sampling.params import SamplingParams
from engine.sched.batch import ScheduledBatch
from engine.sched.scheduler import AdmissionError, Scheduler, SchedulerConfig
from engine.sched.sequence import Sequence, SequenceStatus
from tests.invariants import assert_block_counts, assert_integrity, assert_no_leak, assert_scheduler_idle

VOCAB = 50
MOD = 2**31 - 1


def mix(prev: int, token: int, pos: int) -> int:
    return (prev * 1000003 + token * 31 + pos + 1) % MOD


def next_token(context_kv: list[int], index: int) -> int:
    # index: the completion index, standing in for each completion's own random draw.
    return (context_kv[-1] + sum(context_kv) + 7 * index) % VOCAB


def reference(prompt: list[int], params: SamplingParams, index: int, max_model_len: int) -> list[int]:
    """Outputs of one completion computed without any pool or scheduler."""
    tokens, kvs = list(prompt), []
    while True:
        for pos in range(len(kvs), len(tokens)):
            kvs.append(mix(kvs[-1] if kvs else 0, tokens[pos], pos))
        tok = next_token(kvs, index)
        tokens.append(tok)
        outputs = tokens[len(prompt) :]
        if tok in params.stop_token_ids and len(outputs) - 1 >= params.min_tokens:
            return outputs
        if len(outputs) >= params.max_tokens or len(tokens) >= max_model_len:
            return outputs


class FakeModel:
    def __init__(self, scheduler: Scheduler):
        bm = scheduler.block_manager
        self.scheduler = scheduler
        self.bs = bm.block_size
        self.pool = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bs], pos % self.bs

    def step(self, batch: ScheduledBatch) -> list[int]:
        for src, dst in batch.block_copies:
            self.pool[dst] = list(self.pool[src])
        contexts = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            c = seq.num_computed_tokens
            assert len(seq.block_table) * self.bs >= c + n, "block table too short"
            for pos in range(c, c + n):
                prev = 0
                if pos:
                    block, off = self.slot(seq, pos - 1)
                    prev = self.pool[block][off]
                block, off = self.slot(seq, pos)
                self.pool[block][off] = mix(prev, seq.token_ids[pos], pos)
            contexts.append([self.pool[b][o] for b, o in (self.slot(seq, p) for p in range(c + n))])
        return [
            next_token(contexts[row], self.scheduler.completion_index_of(seq))
            for seq, row in zip(batch.sample_seqs, batch.sample_rows)
        ]


def make_scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = SchedulerConfig(
        **{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64, "prefill_chunk_size": 8, **cfg}
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(seq_id: int, prompt: list[int], **params) -> Sequence:
    p = SamplingParams(**params)
    return Sequence(seq_id, list(prompt), p, stop_token_ids=frozenset(p.stop_token_ids))


def run(scheduler: Scheduler, model: FakeModel) -> dict[tuple[int, int], tuple[list[int], SequenceStatus]]:
    """Step to completion; checks the budget and block integrity every step."""
    cfg, done, steps = scheduler.config, {}, 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert batch is not None, "unfinished work but nothing scheduled"
        assert batch.num_batched_tokens <= cfg.max_num_batched_tokens
        assert all(n == 1 or n <= cfg.prefill_chunk_size for n in batch.num_new_tokens)
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        assert scheduler.num_running <= cfg.max_num_seqs
        for seq in scheduler.running:  # every running sequence holds KV room for what it computes
            assert len(seq.block_table) * scheduler.block_manager.block_size >= seq.num_computed_tokens
        assert_integrity(scheduler.block_manager)
        for seq in scheduler.postprocess(batch, model.step(batch), None):
            done[scheduler.request_id_of(seq), scheduler.completion_index_of(seq)] = (seq.output_token_ids, seq.status)
        steps += 1
        assert steps < 1000
    assert_scheduler_idle(scheduler)
    return done


def prompts():
    return {i: [(i * 13 + k * 7) % VOCAB for k in range(5 + 3 * i)] for i in range(5)}


def test_chunking_budget_and_several_prefills_per_step():
    s = make_scheduler(max_num_batched_tokens=16, prefill_chunk_size=8)
    a, b, c = make_seq(0, list(range(20))), make_seq(1, list(range(5))), make_seq(2, list(range(3)))
    for seq in (a, b, c):
        s.add(seq)
    model = FakeModel(s)
    batch = s.schedule()
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [8, 5, 3]
    assert batch.sample_seqs == [b, c] and batch.sample_rows == [1, 2]
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [2, 3], [4]]
    s.postprocess(batch, model.step(batch), None)
    assert (a.num_computed_tokens, b.num_output_tokens, c.num_output_tokens) == (8, 1, 1)
    # Decodes first, then the rest of a's prompt in chunks.
    batch = s.schedule()
    assert batch.seqs == [b, c, a] and batch.num_new_tokens == [1, 1, 8]
    assert batch.sample_seqs == [b, c] and batch.block_copies == []
    s.postprocess(batch, model.step(batch), None)
    batch = s.schedule()
    assert batch.seqs == [b, c, a] and batch.num_new_tokens == [1, 1, 4]
    assert batch.sample_seqs == [b, c, a] and batch.sample_rows == [0, 1, 2]
    s.postprocess(batch, model.step(batch), None)
    for seq in (a, b, c):
        s.abort(seq.seq_id)
    assert_scheduler_idle(s)


def test_decodes_come_first_under_a_tight_budget():
    s = make_scheduler(max_num_batched_tokens=4, prefill_chunk_size=4)
    a, b = make_seq(0, [1, 2]), make_seq(1, [3, 4])
    s.add(a)
    s.add(b)
    model = FakeModel(s)
    batch = s.schedule()
    assert batch.num_new_tokens == [2, 2]
    s.postprocess(batch, model.step(batch), None)
    c = make_seq(2, list(range(10)))
    s.add(c)
    batch = s.schedule()
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 1, 2]
    assert batch.sample_seqs == [a, b]
    s.postprocess(batch, model.step(batch), None)
    for sid in (0, 1, 2):
        s.abort(sid)
    assert_scheduler_idle(s)


def test_outputs_match_reference_with_a_large_pool():
    s = make_scheduler(num_blocks=256)
    params = dict(max_tokens=12, stop_token_ids=[3])
    for i, prompt in prompts().items():
        s.add(make_seq(i, prompt, **params))
    done = run(s, FakeModel(s))
    for i, prompt in prompts().items():
        expected = reference(prompt, SamplingParams(**params), 0, 64)
        assert done[i, 0][0] == expected


@pytest.mark.parametrize("chunk", [3, 8])
def test_preemption_recomputes_to_the_same_outputs(chunk):
    params = dict(max_tokens=14)
    big = make_scheduler(num_blocks=256, prefill_chunk_size=chunk)
    tiny = make_scheduler(num_blocks=8, prefill_chunk_size=chunk)  # 32 tokens of KV for 5 sequences
    for s in (big, tiny):
        for i, prompt in prompts().items():
            s.add(make_seq(i, prompt, **params))
    expected, got = run(big, FakeModel(big)), run(tiny, FakeModel(tiny))
    assert big.num_preemptions == 0 and tiny.num_preemptions > 0
    # Recomputes reused cached blocks, and the tiny pool had to evict some.
    assert tiny.block_manager.num_prefix_hit_tokens > 0 and tiny.block_manager.num_evicted_blocks > 0
    assert got == expected
    assert all(status == SequenceStatus.FINISHED_LENGTH and len(out) == 14 for out, status in got.values())


def test_preempted_sequence_goes_to_the_front_and_keeps_its_tokens():
    s = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens of KV
    a, b = make_seq(0, list(range(7)), max_tokens=9), make_seq(1, list(range(10, 17)), max_tokens=9)
    s.add(a)
    s.add(b)
    model = FakeModel(s)
    batch = s.schedule()
    assert batch.seqs == [a, b] and a.block_table == [0, 1] and b.block_table == [2, 3]
    s.postprocess(batch, model.step(batch), None)
    # a needs no new block for token 7; b's token 7 also fits. Next step both need a third block.
    batch = s.schedule()
    s.postprocess(batch, model.step(batch), None)
    batch = s.schedule()
    assert batch.seqs == [a] and s.num_preemptions == 1
    assert list(s.waiting) == [b] and b.status == SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_output_tokens == 2
    # b released tail first: its partial block 3 was freed (and went to a), its full block 2 stays cached.
    assert a.block_table == [0, 1, 3]
    assert_block_counts(s.block_manager, free=0, cached=1, in_use=3)
    s.postprocess(batch, model.step(batch), None)
    done = run(s, model)
    for seq in (a, b):
        assert done[seq.seq_id, 0][0] == reference(seq.prompt_token_ids, seq.params, 0, 64)


def test_n3_children_share_prompt_blocks_and_decode_independently():
    s = make_scheduler(num_blocks=32, block_size=4, prefill_chunk_size=16)
    params = dict(n=3, max_tokens=6)
    parent = make_seq(5, list(range(10)), **params)
    s.add(parent)
    model = FakeModel(s)
    batch = s.schedule()
    c1, c2 = batch.sample_seqs[1:]
    assert batch.seqs == [parent] and batch.sample_seqs == [parent, c1, c2] and batch.sample_rows == [0, 0, 0]
    assert (c1.seq_id, c2.seq_id) == (-1, -2)
    assert [s.request_id_of(q) for q in (parent, c1, c2)] == [5, 5, 5]
    assert [s.completion_index_of(q) for q in (parent, c1, c2)] == [0, 1, 2]
    assert parent.block_table == c1.block_table == c2.block_table == [0, 1, 2]
    assert s.block_manager.ref_counts[:3] == [3, 3, 3]
    assert_block_counts(s.block_manager, free=29, cached=0, in_use=3)
    s.postprocess(batch, model.step(batch), None)
    assert [q.num_computed_tokens for q in (parent, c1, c2)] == [10, 10, 10]
    assert len({q.token_ids[-1] for q in (parent, c1, c2)}) == 3
    # First decode: block 2 holds tokens 8, 9 and is shared: two copies, the last writer keeps it.
    batch = s.schedule()
    assert batch.seqs == [parent, c1, c2] and batch.block_copies == [(2, 3), (2, 4)]
    assert [q.block_table for q in (parent, c1, c2)] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    assert_block_counts(s.block_manager, free=27, cached=0, in_use=5)
    s.postprocess(batch, model.step(batch), None)
    done = run(s, model)
    for index in range(3):
        assert done[5, index][0] == reference(list(range(10)), SamplingParams(**params), index, 64)


def test_n3_under_preemption_matches_reference():
    params = dict(n=3, max_tokens=8)
    s = make_scheduler(num_blocks=9, block_size=4, prefill_chunk_size=4)
    for i in range(2):
        s.add(make_seq(i, [i + 1] * 9, **params))
    done = run(s, FakeModel(s))
    assert s.num_preemptions > 0
    for i in range(2):
        for index in range(3):
            assert done[i, index][0] == reference([i + 1] * 9, SamplingParams(**params), index, 64)


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler(num_blocks=32, block_size=4)
    model = FakeModel(s)
    first = make_seq(0, list(range(10)), max_tokens=2)
    s.add(first)
    run(s, model)
    second = make_seq(1, list(range(9)) + [40, 41], max_tokens=2)
    s.add(second)
    batch = s.schedule()
    assert batch.num_new_tokens == [3] and second.num_cached_tokens == 8
    assert second.block_table[:2] == [0, 1]
    s.postprocess(batch, model.step(batch), None)
    done = run(s, model)
    assert done[1, 0][0] == reference(second.prompt_token_ids, second.params, 0, 64)


def abort_and_check(s: Scheduler, seq: Sequence) -> None:
    assert s.abort(seq.seq_id) == [seq]
    assert seq.status == SequenceStatus.FINISHED_ABORTED and seq.block_table == []
    assert s.abort(seq.seq_id) == []  # idempotent


@pytest.mark.parametrize("phase", ["waiting", "prefilling", "decoding", "in_flight", "preempted"])
def test_abort_at_each_phase_frees_everything(phase):
    s = make_scheduler(num_blocks=16, block_size=4, prefill_chunk_size=4, max_num_seqs=1)
    model = FakeModel(s)
    seq = make_seq(0, list(range(10)), max_tokens=20)
    other = make_seq(1, list(range(20, 26)), max_tokens=20)
    s.add(seq)
    s.add(other)
    if phase == "waiting":
        abort_and_check(s, seq)
    else:
        batch = s.schedule()  # chunk 0..3 of seq
        if phase == "in_flight":
            sampled = model.step(batch)
            abort_and_check(s, seq)  # after the runner, before postprocess
            assert s.postprocess(batch, sampled, None) == []
        else:
            s.postprocess(batch, model.step(batch), None)
            if phase in ("decoding", "preempted"):
                while seq.num_output_tokens == 0:
                    batch = s.schedule()
                    s.postprocess(batch, model.step(batch), None)
            if phase == "preempted":
                s._preempt(seq)
                assert seq.status == SequenceStatus.WAITING and s.num_waiting == 2
            abort_and_check(s, seq)
    assert_no_leak(s.block_manager) if s.num_running == 0 else assert_integrity(s.block_manager)
    done = run(s, model)  # the other sequence is unaffected
    assert done[1, 0][0] == reference(other.prompt_token_ids, other.params, 0, 64)


def test_abort_of_a_parent_aborts_its_children():
    s = make_scheduler(num_blocks=32)
    model = FakeModel(s)
    parent = make_seq(0, list(range(6)), n=3, max_tokens=10)
    s.add(parent)
    batch = s.schedule()
    s.postprocess(batch, model.step(batch), None)
    assert s.num_running == 3
    aborted = s.abort(0)
    assert len(aborted) == 3 and all(q.status == SequenceStatus.FINISHED_ABORTED for q in aborted)
    assert_scheduler_idle(s)


def scripted(s: Scheduler, seq: Sequence, tokens: list[int]) -> list[int]:
    """Feed the given tokens as samples; return how many were consumed before the sequence finished."""
    s.add(seq)
    for i, tok in enumerate(tokens):
        batch = s.schedule()
        finished = s.postprocess(batch, [tok] * len(batch.sample_seqs), None)
        if finished:
            assert finished == [seq]
            return i + 1
    raise AssertionError("did not finish")


def test_stop_token_respects_min_tokens():
    s = make_scheduler()
    seq = make_seq(0, [1, 2, 3], stop_token_ids=[7], min_tokens=2, max_tokens=10)
    assert scripted(s, seq, [7, 7, 7, 7]) == 3
    assert seq.output_token_ids == [7, 7, 7] and seq.status == SequenceStatus.FINISHED_STOPPED
    assert_scheduler_idle(s)


def test_max_tokens_and_stop_precedence():
    s = make_scheduler()
    seq = make_seq(0, [1, 2, 3], stop_token_ids=[7], max_tokens=3)
    assert scripted(s, seq, [4, 5, 6, 8]) == 3
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.output_token_ids == [4, 5, 6]
    last = make_seq(1, [1, 2, 3], stop_token_ids=[7], max_tokens=2)
    assert scripted(s, last, [4, 7]) == 2
    assert last.status == SequenceStatus.FINISHED_STOPPED
    assert_scheduler_idle(s)


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=8)
    seq = make_seq(0, list(range(6)), max_tokens=10)
    assert scripted(s, seq, [1, 1, 1]) == 2
    assert seq.num_tokens == 8 and seq.status == SequenceStatus.FINISHED_LENGTH
    assert_scheduler_idle(s)


def test_add_rejects_what_can_never_run():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=8192)
    with pytest.raises(AdmissionError, match="prompt has 9000 tokens; this model's context is 8192"):
        s.add(make_seq(0, [1] * 9000))
    with pytest.raises(AdmissionError, match="KV for 19 tokens .* the KV pool holds 16 tokens"):
        s.add(make_seq(1, [1] * 10, max_tokens=10))
    with pytest.raises(AdmissionError, match="n=9 completions exceed max_num_seqs=8"):
        s.add(make_seq(2, [1] * 2, n=9))
    fits = make_seq(3, [1] * 10, max_tokens=7)  # KV for 16 tokens: exactly the pool
    s.add(fits)
    with pytest.raises(ValueError, match="seq_id 3"):
        s.add(make_seq(3, [1]))
    run(s, FakeModel(s))
    assert fits.num_output_tokens == 7
    assert_scheduler_idle(s)


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(make_seq(i, [i, i + 1], max_tokens=3))
    model = FakeModel(s)
    batch = s.schedule()
    assert len(batch.seqs) == 2 and s.num_running == 2 and s.num_waiting == 2
    s.postprocess(batch, model.step(batch), None)
    done = run(s, model)  # run() asserts num_running <= max_num_seqs every step
    assert len(done) == 4


def test_children_keep_their_prompt_kv_when_the_parent_stops_at_once():
    s = make_scheduler(num_blocks=32, block_size=4, prefill_chunk_size=16)
    parent = make_seq(0, list(range(10)), n=3, max_tokens=5, stop_token_ids=[7])
    s.add(parent)
    batch = s.schedule()
    c1, c2 = batch.sample_seqs[1:]
    finished = s.postprocess(batch, [7, 1, 2], None)  # the parent samples its stop token
    assert finished == [parent] and parent.status == SequenceStatus.FINISHED_STOPPED
    assert [c1.num_computed_tokens, c2.num_computed_tokens] == [10, 10]
    assert c1.block_table == c2.block_table == [0, 1, 2]
    assert s.block_manager.ref_counts[:3] == [2, 2, 2]
    assert_block_counts(s.block_manager, free=29, cached=0, in_use=3)
    assert s.num_running == 2 and s.request_id_of(c2) == 0
    assert len(s.abort(0)) == 2  # the request's remaining completions
    assert_scheduler_idle(s)
