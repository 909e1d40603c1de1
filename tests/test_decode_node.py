"""Decode worker in-process (server loop on a thread) against a fake gateway: outputs equal the
single-process engine's, aborts and Busy free everything, a remote prefill lands the right KV."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import zmq

from decode_node.node import DecodeNode
from engine.llm import LLM, build_engine
from engine.sampling.params import SamplingParams
from kvtransfer.channel import ZmqClient
from kvtransfer.sender import KVSender
from protocol.codec import decode, encode
from protocol.serving import AbortRequest, Busy, HeartbeatAck, PrefillFailed, PrefillJob, TokenBias
from protocol.zmq_util import bind, make_socket
from tests.decode_harness import FakeGateway, decode_config, generate, scrape, tokens_of
from tests.invariants import assert_no_leak
from worker import kv_model_name

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 77]  # 13 tokens: 3 full blocks of 4 and 1 token


class Running:
    def __init__(self, decode: dict | None = None, **engine):
        self.ctx = zmq.Context()
        self.gateway = FakeGateway(self.ctx)
        self.config = decode_config(self.gateway.address, decode, **engine)
        self.node = DecodeNode.start(self.config, self.ctx)
        self.thread = threading.Thread(target=self.node.server.run, daemon=True)
        self.thread.start()
        self.gateway.wait_heartbeat(lambda hb: True)  # registered

    def reference(self, prompt, params: SamplingParams):
        llm = LLM(self.config.model.path, config=self.config)
        return llm.generate([prompt], params)[0]

    def close(self):
        self.node.server.stop()
        self.thread.join(timeout=10)
        bm = self.node.server.block_manager
        self.node.close()
        self.ctx.destroy(linger=0)
        return bm


@pytest.fixture
def node():
    running = Running()
    yield running
    bm = running.close()
    assert_no_leak(bm)


def assert_idle(node: Running) -> None:
    hb = node.gateway.wait_heartbeat(
        lambda hb: hb.kv_blocks_in_use == 0 and hb.num_running == 0 and hb.num_waiting == 0
    )
    assert hb.kv_blocks_free == hb.kv_blocks_total == 32
    assert scrape(node.node.http.port, "pdserve:kv_blocks_in_use") == 0
    assert node.node.server.requests == {}


def test_local_prefill_greedy_equals_engine(node):
    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    node.gateway.send("d0", generate("r1", PROMPT, **params))
    events = node.gateway.collect("r1")[0]
    expected = node.reference(PROMPT, SamplingParams(**params)).outputs[0]
    assert tokens_of(events) == expected.token_ids
    assert events[-1].finish_reason == "length" and events[0].num_cached_tokens == 0
    lps = [lp for e in events for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == expected.token_ids
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    assert all(len(lp.top_ids) == 2 for lp in lps)
    assert_idle(node)
    # The same prompt again is a prefix hit: 3 full blocks (12 tokens) are not recomputed.
    node.gateway.send("d0", generate("r2", PROMPT, **params))
    again = node.gateway.collect("r2")[0]
    assert tokens_of(again) == expected.token_ids and again[0].num_cached_tokens == 12
    assert scrape(node.node.http.port, "vllm:prefix_cache_hits_total") == 12
    assert_idle(node)


def test_n3_seeded_completions_equal_engine(node):
    params = dict(max_tokens=6, n=3, temperature=1.0, seed=11, ignore_eos=True)
    node.gateway.send("d0", generate("r", PROMPT, **params))
    events = node.gateway.collect("r", n=3)
    expected = node.reference(PROMPT, SamplingParams(**params))
    assert [tokens_of(events[i]) for i in range(3)] == [o.token_ids for o in expected.outputs]
    # Each decode step's three events came in one frame (the first step's too: the forks sample at once).
    assert node.gateway.batch_sizes == [3] * 6
    assert_idle(node)


def test_prompt_logprobs_with_n2_are_computed_here_in_full_and_sent_first(node):
    prefill = make_socket(node.ctx, zmq.ROUTER)  # a prefill worker that must not be asked: n > 1 prefills here
    prefill_address = bind(prefill, "127.0.0.1", 0)
    node.gateway.send("d0", generate("warm", PROMPT, max_tokens=2))  # caches the prompt's 3 full blocks
    node.gateway.collect("warm")
    params = dict(max_tokens=4, n=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    node.gateway.send("d0", generate("r", PROMPT, prefill_address=prefill_address, **params))
    events = node.gateway.collect("r", n=2)
    expected = node.reference(PROMPT, SamplingParams(**params))
    mine = [r for r in node.gateway.others if getattr(r, "rid", "") == "r"]
    assert type(mine[0]).__name__ == "PromptLogprobs" and isinstance(mine[1], type(events[0][0]))
    frame = mine[0]
    assert frame.start == 0 and [r.token_id for r in frame.logprobs] == PROMPT[1:]
    want = expected.prompt_logprobs[1:]
    assert frame.ranks == [e.rank for e in want]
    assert [r.top_ids for r in frame.logprobs] == [[t for t, _ in e.top] for e in want]
    assert [r.logprob for r in frame.logprobs] == pytest.approx([e.logprob for e in want], abs=1e-5)
    assert [tokens_of(events[i]) for i in range(2)] == [o.token_ids for o in expected.outputs]
    assert events[0][0].num_cached_tokens == 0  # the cached prefix was not used: it has no logits
    assert not prefill.poll(100)
    prefill.close(linger=0)
    assert_idle(node)


def test_abort_while_decoding_frees_everything(node):
    node.gateway.send("d0", generate("long", PROMPT, max_tokens=100, ignore_eos=True, temperature=0.0))
    node.gateway.recv(until=lambda r: getattr(r, "rid", "") == "long" and r.offset >= 1)
    node.gateway.send("d0", AbortRequest("long", "client disconnected"))
    assert_idle(node)
    streamed = [r for r in node.gateway.others if getattr(r, "rid", "") == "long"]
    assert not any(e.finish_reason or e.error for e in streamed)  # cut short, silently: the gateway asked
    assert sum(len(e.token_ids) for e in streamed) < 100


def test_busy_when_pool_cannot_hold_request(node):
    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)  # a prefill worker that never answers: "a" holds its blocks
    node.gateway.send("d0", generate("a", list(range(1, 101)), prefill_address=prefill_address))
    assert prefill.poll(30_000) and decode(prefill.recv_multipart()[1], expected=PrefillJob).rid == "a"
    node.gateway.wait_heartbeat(lambda hb: hb.kv_blocks_in_use == 25)  # 100 tokens in blocks of 4
    # The reservation's 100 slots are all spoken for: the utilisation gauges count them live.
    assert scrape(node.node.http.port, "pdserve:kv_live_slots") == 100
    assert scrape(node.node.http.port, "pdserve:kv_slot_utilization") == 1.0
    # 40 prompt tokens need 10 blocks + 1 to decode into; 7 are left. Local and remote alike.
    node.gateway.send("d0", generate("b", list(range(1, 41))))
    busy = node.gateway.recv(until=lambda r: isinstance(r, Busy))
    assert busy.rid == "b" and busy.reason == "KV pool full: needs 11 blocks, 7 available"
    node.gateway.send("d0", generate("c", list(range(1, 41)), prefill_address=prefill_address))
    busy = node.gateway.recv(until=lambda r: isinstance(r, Busy))
    assert busy.rid == "c" and busy.reason == "KV pool full: 7 blocks available"
    node.gateway.send("d0", AbortRequest("a"))
    assert decode(prefill.recv_multipart()[1], expected=AbortRequest).rid == "a"  # forwarded
    prefill.close(linger=0)
    assert_idle(node)


def test_an_engine_step_that_raises_fails_its_requests_blaming_this_worker_and_the_loop_goes_on(node):
    runner = node.node.server.engine.runner
    execute, calls = runner.execute, []

    def execute_once_broken(batch):  # the step after the first raises, as a device error would
        calls.append(batch)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(batch)

    runner.execute = execute_once_broken
    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    node.gateway.send("d0", generate("broken", PROMPT, **params))
    events = node.gateway.collect("broken")[0]
    assert events[-1].error == "internal error on the decode worker: an engine step failed"
    assert events[-1].culprit == "decode"
    assert scrape(node.node.http.port, "pdserve:engine_step_errors_total") == 1
    assert_idle(node)
    node.gateway.send("d0", generate("after", PROMPT, **params))  # same process, exact output
    expected = node.reference(PROMPT, SamplingParams(**params)).outputs[0]
    assert tokens_of(node.gateway.collect("after")[0]) == expected.token_ids
    assert_idle(node)


def test_bad_request_gets_error_event(node):
    node.gateway.send("d0", generate("bad", [5, 100000]))
    [event] = node.gateway.collect("bad")[0]
    assert event.error == "prompt token id 100000 is outside this model's vocabulary of 768 tokens"
    assert event.refused and event.culprit == "none"  # the client's request: nobody's breaker counts it
    node.gateway.send("d0", generate("bias", [5, 6], logit_bias=[TokenBias(768, 1.0)]))
    [event] = node.gateway.collect("bias")[0]
    assert event.error == "logit_bias token id 768 is outside this model's vocabulary of 768 tokens"
    node.gateway.send("d0", generate("range", [5, 6], logit_bias=[TokenBias(7, 101.0)]))
    [event] = node.gateway.collect("range")[0]
    assert event.error.startswith("logit_bias must be a map of non-negative token ids to biases in [-100, 100]")
    node.gateway.send("d0", generate("long", list(range(1, 300))))
    [event] = node.gateway.collect("long")[0]
    assert "prompt has 299 tokens; this model's context is 256" in event.error
    assert_idle(node)


def test_remote_prefill_job_and_kv_land(node):
    ctx = node.ctx
    prefill = make_socket(ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = node.reference(PROMPT, SamplingParams(**params)).outputs[0].token_ids
    node.gateway.send("d0", generate("r", PROMPT, prefill_address=prefill_address, **params))
    assert prefill.poll(30_000)
    identity, frame = prefill.recv_multipart()
    job = decode(frame, expected=PrefillJob)
    assert identity == b"d0"
    # A fresh pool: nothing cached, 13 tokens -> blocks 0..3 from the FIFO free list.
    assert (job.skip_tokens, job.dst_block_ids, job.token_ids, job.sample_first) == (0, [0, 1, 2, 3], PROMPT, True)
    assert job.kv_address == node.node.server.options.kv_address
    hb = node.gateway.wait_heartbeat(lambda hb: hb.num_waiting == 1)
    assert hb.kv_blocks_in_use == 4

    # Play the prefill worker: compute the prompt's KV in an engine of our own, ship it, commit.
    p_engine = build_engine(node.config.model.path, node.config.model, node.config.engine)
    p_engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while p_engine.has_unfinished():
        [out] = p_engine.step() or [None]
    first_token = out.outputs[0].token_ids[0]
    assert first_token == expected[0]
    sender = KVSender(p_engine.runner.kv_pool, kv_model_name(node.config.model.path), ZmqClient(ctx, job.kv_address))
    sender.handshake(timeout_s=10)
    sender.send(job.rid, job.generation, [0, 1, 2, 3], job.dst_block_ids)  # P's own blocks 0..3 (fresh pool)
    sender.commit(job.rid, job.generation, first_token=first_token)
    events = []
    while not events:
        events = sender.poll()
    assert events[0].ok, events[0].reason
    got = node.gateway.collect("r")[0]
    assert tokens_of(got, first_offset=1) == expected[1:]
    assert got[0].num_cached_tokens == 0
    assert torch.equal(node.node.receiver.pool.tensor[:, :, :3], p_engine.runner.kv_pool.tensor[:, :, :3])
    prefill.close(linger=0)
    assert_idle(node)


def test_steps_take_the_prefill_workers_threads_only_while_no_prompt_is_out():
    # One thread of its own and one of the prefill worker's beside it (as pdserve serve sets 1P+1D).
    node = Running(decode={"idle_prefill_threads": 1})
    threads: list[int] = []  # each step's thread count, read as the step runs
    execute = node.node.server.engine.runner.execute

    def recording(batch):
        threads.append(torch.get_num_threads())
        return execute(batch)

    node.node.server.engine.runner.execute = recording
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = node.reference(PROMPT, SamplingParams(**params)).outputs[0].token_ids
    other = PROMPT[::-1]
    expected_other = node.reference(other, SamplingParams(**params)).outputs[0].token_ids

    node.gateway.send("d0", generate("alone", PROMPT, **params))  # nothing out: every step takes both
    assert tokens_of(node.gateway.collect("alone")[0]) == expected
    assert threads == [2] * len(threads) and len(threads) >= 8

    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)
    node.gateway.send("d0", generate("remote", other, prefill_address=prefill_address, **params))
    assert prefill.poll(30_000)
    job = decode(prefill.recv_multipart()[1], expected=PrefillJob)
    # While that prompt is out, a request prefilled here runs start to end on this worker's own thread.
    before = len(threads)
    node.gateway.send("d0", generate("local", PROMPT, **params))
    assert tokens_of(node.gateway.collect("local")[0]) == expected
    assert threads[before:] == [1] * (len(threads) - before) and len(threads) - before >= 8

    # The KV lands: the remote request's steps take both threads again.
    p_engine = build_engine(node.config.model.path, node.config.model, node.config.engine)
    p_engine.add_request(other, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while p_engine.has_unfinished():
        [out] = p_engine.step() or [None]
    sender = KVSender(
        p_engine.runner.kv_pool, kv_model_name(node.config.model.path), ZmqClient(node.ctx, job.kv_address)
    )
    sender.handshake(timeout_s=10)
    committed = len(threads)
    sender.send(job.rid, job.generation, [0, 1, 2, 3], job.dst_block_ids)
    sender.commit(job.rid, job.generation, first_token=out.outputs[0].token_ids[0])
    events = []
    while not events:
        events = sender.poll()
    assert events[0].ok, events[0].reason
    assert tokens_of(node.gateway.collect("remote")[0], first_offset=1) == expected_other[1:]
    assert threads[committed:] == [2] * (len(threads) - committed) and len(threads) - committed == 7
    prefill.close(linger=0)
    assert_idle(node)
    assert_no_leak(node.close())


def test_prefill_failed_ends_request_with_error_and_frees(node):
    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)
    node.gateway.send("d0", generate("r", PROMPT, prefill_address=prefill_address, n=2))
    assert prefill.poll(30_000)
    identity, frame = prefill.recv_multipart()
    job = decode(frame, expected=PrefillJob)
    assert (job.token_ids, job.sample_first, job.dst_block_ids) == (
        PROMPT[:-1],
        False,
        [0, 1, 2],
    )  # n > 1: all but the last
    prefill.send_multipart([identity, encode(PrefillFailed("r", job.generation, "out of blocks"))])
    events = node.gateway.collect("r", n=2)
    assert [events[i][-1].error for i in range(2)] == ["prefill failed: out of blocks"] * 2
    assert [events[i][-1].culprit for i in range(2)] == ["prefill"] * 2  # its own failure, as it said
    # A prefill worker that could not reach this worker's KV receiver says so: the gateway hears it.
    node.gateway.send("d0", generate("r2", PROMPT, prefill_address=prefill_address))
    assert prefill.poll(30_000)
    identity, frame = prefill.recv_multipart()
    job = decode(frame, expected=PrefillJob)
    failed = PrefillFailed("r2", job.generation, "handshake with the receiver failed", culprit="decode")
    prefill.send_multipart([identity, encode(failed)])
    [event] = node.gateway.collect("r2")[0]
    assert (event.error, event.culprit) == ("prefill failed: handshake with the receiver failed", "decode")
    prefill.close(linger=0)
    assert_idle(node)


def test_abort_while_awaiting_kv_is_forwarded_and_frees(node):
    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)
    node.gateway.send("d0", generate("r", PROMPT, prefill_address=prefill_address))
    assert prefill.poll(30_000)
    decode(prefill.recv_multipart()[1], expected=PrefillJob)
    node.gateway.send("d0", AbortRequest("r", "client gone"))
    assert prefill.poll(30_000)
    forwarded = decode(prefill.recv_multipart()[1], expected=AbortRequest)
    assert forwarded.rid == "r"
    prefill.close(linger=0)
    assert_idle(node)
    assert node.node.receiver.table.held_blocks() == {}


@pytest.fixture
def held_compiles(node):
    """Grammar compiles wait until the test lets them go (Event.set): a compile as slow as the test needs."""
    grammars = node.node.server.engine.grammars
    gate, compile_now = threading.Event(), grammars.guide

    def held(spec):
        assert gate.wait(60)
        return compile_now(spec)

    grammars.guide = held
    yield gate
    gate.set()


def test_other_requests_decode_while_a_grammar_compiles(node, held_compiles):
    from protocol.serving import StructuredOutput

    regex = StructuredOutput("regex", "(ab|cd){2,6}")
    node.gateway.send("d0", generate("plain", PROMPT, max_tokens=40, ignore_eos=True, temperature=0.0))
    node.gateway.send("d0", generate("guided", PROMPT[:7], max_tokens=20, temperature=0.0, structured_output=regex))
    plain = node.gateway.collect("plain")[0]  # all 40 tokens come while the compile is held
    node.gateway.wait_heartbeat(lambda hb: hb.num_waiting == 1 and hb.num_running == 0)  # "guided" compiles
    assert (
        tokens_of(plain)
        == node.reference(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)).outputs[0].token_ids
    )
    assert not any(getattr(r, "rid", "") == "guided" for r in node.gateway.others)
    held_compiles.set()
    guided = node.gateway.collect("guided")[0]
    expected = node.reference(PROMPT[:7], SamplingParams(max_tokens=20, temperature=0.0, structured_output=regex))
    assert tokens_of(guided) == expected.outputs[0].token_ids and guided[-1].finish_reason == "stop"
    assert_idle(node)


def test_abort_deadline_and_a_bad_grammar_while_compiling(node, held_compiles):
    from protocol.serving import StructuredOutput

    node.gateway.send("d0", generate("aborted", PROMPT, structured_output=StructuredOutput("regex", "a+")))
    node.gateway.send("d0", generate("late", PROMPT, timeout_s=0.5, structured_output=StructuredOutput("regex", "b+")))
    node.gateway.send("d0", generate("bad", PROMPT, structured_output=StructuredOutput("regex", "a(b")))
    node.gateway.send("d0", AbortRequest("aborted", "client disconnected"))
    [late] = node.gateway.collect("late")[0]
    assert late.error == "deadline exceeded" and not late.refused
    held_compiles.set()
    [bad] = node.gateway.collect("bad")[0]
    assert bad.refused and bad.error.startswith("invalid regex: Regex parsing error at position 4")
    assert_idle(node)
    assert not any(getattr(r, "rid", "") == "aborted" for r in node.gateway.others)  # cut short, silently


def test_a_grammar_compile_past_its_deadline_refuses_its_request(node, held_compiles):
    from engine.sampling.grammar_compiles import GrammarLimits
    from protocol.serving import StructuredOutput

    grammars = node.node.server.engine.grammars
    grammars._load()  # the tokenizer's one-time load is not the request's: deadlines count from here
    grammars._limits = GrammarLimits(compile_timeout_s=0.5)
    node.gateway.send("d0", generate("slow", PROMPT, structured_output=StructuredOutput("regex", "a+")))
    [slow] = node.gateway.collect("slow")[0]  # its compile is held: only the deadline ends the wait
    assert slow.refused and slow.error == (
        "the grammar did not compile within this server's limit of 0.5 s (engine.grammar_compile_timeout_s)"
    )
    held_compiles.set()
    node.gateway.send("d0", generate("plain", PROMPT, max_tokens=4, ignore_eos=True, temperature=0.0))
    assert len(tokens_of(node.gateway.collect("plain")[0])) == 4  # the worker serves on


def test_lost_gateway_aborts_its_requests_and_frees_their_blocks(node):
    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)  # a prefill worker that never answers: "a" waits for KV
    node.gateway.wait_heartbeat(lambda hb: True)
    node.gateway.send("d0", HeartbeatAck("gw-1"))  # as a real gateway acks: the worker knows it by its id
    node.gateway.send(
        "d0", replace(generate("a", list(range(1, 101)), prefill_address=prefill_address), gateway_id="gw-1")
    )
    assert prefill.poll(30_000) and decode(prefill.recv_multipart()[1], expected=PrefillJob).rid == "a"
    node.gateway.wait_heartbeat(lambda hb: hb.kv_blocks_in_use == 25)
    old = node.gateway
    old.sock.close(linger=0)  # the gateway is gone: nobody will ever read "a"'s tokens
    node.gateway = FakeGateway(node.ctx, old.address)  # a new gateway process on the same port
    # The decode worker dropped "a" when the connection closed, long before its 10 s lease: its next
    # registration shows nothing held, it counts an abort and no expired lease, and P was told.
    node.gateway.wait_heartbeat(lambda hb: hb.kv_blocks_in_use == 0 and hb.num_waiting == 0)
    assert scrape(node.node.http.port, 'pdserve:request_failure_total{reason="aborted"}') == 1
    assert scrape(node.node.http.port, "pdserve:kv_lease_expired_total") == 0
    assert decode(prefill.recv_multipart()[1], expected=AbortRequest).rid == "a"
    prefill.close(linger=0)
    assert_idle(node)
