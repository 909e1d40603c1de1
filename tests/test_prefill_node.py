"""The prefill worker against a real KV receiver (the test plays the decode worker) and a real ROUTER
(the test plays the gateway). Expectations come from a single in-test engine run on the same prompt."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from configs.schema import EngineConfig, ModelConfig
from engine.kv.block_manager import cdiv
from engine.llm import build_engine
from engine.sampling.params import SamplingParams
from kvtransfer.channel import ZmqServer
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.shm_pool import create_shared
from prefill_node.job import JobPhase
from prefill_node.metrics import PrefillMetrics
from prefill_node.options import PrefillOptions
from prefill_node.server import PrefillServer
from protocol.codec import decode, encode
from protocol.serving import (
    AbortRequest,
    Goodbye,
    Heartbeat,
    HeartbeatAck,
    PrefillFailed,
    PrefillJob,
    SamplingSpec,
    TokenBias,
    TokenEvent,
)
from protocol.zmq_util import bind, make_socket
from tests.invariants import assert_integrity, assert_no_leak
from tests.model_factory import tiny_model_dir
from worker import serve_http
from worker.identity import kv_model_name

BS = 4
CHUNK = 8  # prompt tokens per job per step: a 19-token prompt takes 3 chunks


def model_path() -> str:
    return str(tiny_model_dir("llama"))


def engine_cfg(**overrides) -> EngineConfig:
    fields = dict(block_size=BS, num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=16, prefill_chunk_size=CHUNK)
    fields.update(overrides)
    return EngineConfig(**fields)


def build(**overrides):
    return build_engine(
        model_path(), ModelConfig(path=model_path(), dtype="float32"), engine_cfg(**overrides), device="cpu"
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 768, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(tokens: list[int], **engine_overrides) -> tuple[torch.Tensor, int]:
    """(KV of every prompt token [L, 2, n, kvh, d], greedy first token) from a single engine alone."""
    eng = build(enable_prefix_caching=False, **engine_overrides)
    eng.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        batch = eng.scheduler.schedule()
        out = eng.runner.execute(batch)
        seq = batch.seqs[0]
        if seq.num_computed_tokens + batch.num_new_tokens[0] == len(tokens):
            kv = eng.runner.kv_pool.tensor[:, :, seq.block_table].clone()  # [L, 2, nb, bs, kvh, d]
            return kv.flatten(2, 3)[:, :, : len(tokens)], out.token_ids[0]
        eng.scheduler.postprocess(batch, out.token_ids, out.logprobs)


class FakeDecode:
    """The decode worker's side: a real KVReceiver on a ZmqServer (shm pool when asked), polled on a
    thread, its own free list, and a DEALER to the prefill worker's job socket."""

    def __init__(self, ctx: zmq.Context, layout, prefill_address: str, transport: str = "shm", credits: int = 64):
        self.registry = CollectorRegistry()
        self.transport = transport
        self.shared = create_shared(layout.shape, layout.dtype) if transport == "shm" else None
        from engine.kv.pool import KVPool

        pool = KVPool(layout, tensor=self.shared.tensor if self.shared else None)
        self.free = set(range(layout.num_blocks))
        self.server = ZmqServer(ctx, "127.0.0.1", max_msg_size=64 << 20)
        self.rx = KVReceiver(
            pool,
            kv_model_name(model_path()),
            self.server,
            self.free.update,
            TransferMetrics(self.registry),
            credits=credits,
            shm_pool_name=self.shared.name if self.shared else None,
        )
        self.jobs = make_socket(ctx, zmq.DEALER)
        self.jobs.connect(prefill_address)
        self.lock = threading.Lock()
        self.events = []
        self.paused = threading.Event()  # set: stop polling (a stalled receiver)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.paused.is_set():
                with self.lock:
                    self.events += self.rx.poll()
            time.sleep(0.0005)

    def reserve(self, rid: str, generation: int, num_blocks: int) -> list[int]:
        with self.lock:
            ids = sorted(self.free, reverse=True)[:num_blocks]  # ids that differ from the sender's
            self.free -= set(ids)
            self.rx.reserve(rid, generation, ids)
        return ids

    def job(
        self,
        rid: str,
        tokens: list[int],
        skip: int = 0,
        generation: int = 1,
        sample_first: bool = True,
        deadline_s: float = 30.0,
        logprobs: int | None = None,
    ) -> PrefillJob:
        dst = self.reserve(rid, generation, cdiv(len(tokens) - skip, BS))
        return PrefillJob(
            rid,
            tokens,
            skip,
            dst,
            generation,
            self.server.endpoint,
            sample_first,
            SamplingSpec(max_tokens=4, temperature=0.0, logprobs=logprobs),
            time.time() + deadline_s,
        )

    def send(self, record) -> None:
        self.jobs.send(encode(record))

    def wait_event(self, rid: str, timeout: float = 20.0):
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            with self.lock:
                for e in self.events:
                    if e.rid == rid:
                        self.events.remove(e)
                        return e
            time.sleep(0.002)
        raise AssertionError(f"no transfer event for {rid}")

    def adopt(self, rid: str) -> tuple[int, ...]:
        with self.lock:
            ids = self.rx.adopt(rid)
            self.free.update(ids)
        return ids

    def recv_failed(self, timeout_ms: int = 10000) -> PrefillFailed:
        assert self.jobs.poll(timeout_ms), "no PrefillFailed"
        return decode(self.jobs.recv(), expected=PrefillFailed)

    def kv_tokens(self, dst: list[int], n: int) -> torch.Tensor:
        """[L, 2, n, kvh, d]: the first n tokens held in blocks ``dst``."""
        return self.rx.pool.tensor[:, :, dst].flatten(2, 3)[:, :, :n]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.rx.close()
        self.jobs.close(linger=0)
        if self.shared:
            self.shared.unlink()


class FakeGateway:
    def __init__(self, ctx: zmq.Context):
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.address = bind(self.sock, "127.0.0.1")
        self.records = []

    def wait(self, kind: type, pred=lambda r: True, timeout: float = 20.0):
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            for r in self.records:
                if isinstance(r, kind) and pred(r):
                    return r
            if self.sock.poll(20):
                _, payload = self.sock.recv_multipart()
                self.records.append(decode(payload))
        raise AssertionError(f"no {kind.__name__} from the prefill worker")


class Cluster:
    """A prefill server (driven by the test, or on its own thread), a fake gateway, a fake decode worker."""

    def __init__(
        self,
        transport: str = "shm",
        credits: int = 64,
        deadline_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        gateway_timeout_s: float = 15.0,
        **engine_overrides,
    ):
        self.ctx = zmq.Context()
        self.gateway = FakeGateway(self.ctx)
        self.engine = build(**engine_overrides)
        options = PrefillOptions(
            worker_id="prefill-test",
            gateway_address=self.gateway.address,
            heartbeat_s=0.2,
            transfer_deadline_s=deadline_s,
            drain_timeout_s=5.0,
            handshake_timeout_s=handshake_timeout_s,
            gateway_timeout_s=gateway_timeout_s,
        )
        self.metrics = PrefillMetrics(CollectorRegistry())
        self.server = PrefillServer(self.engine, kv_model_name(model_path()), self.ctx, options, self.metrics)
        self.decode = FakeDecode(self.ctx, self.engine.runner.kv_pool.layout, self.server.address, transport, credits)
        self.thread: threading.Thread | None = None
        self.handshake()

    def handshake(self) -> None:
        """Handshake with the fake decode worker up front, so the tests' step counts are exact."""
        give_up = time.monotonic() + 10
        while not self.server.senders.prepare(self.decode.server.endpoint):
            assert time.monotonic() < give_up, "no handshake reply"
            self.server.senders.poll()
            time.sleep(0.001)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> None:
        """Wait until what the test sent sits in P's job socket (local TCP: well within 50 ms)."""
        assert self.server.router.poll(2000)
        time.sleep(0.05)

    def turn(self, times: int = 1) -> None:
        for _ in range(times):
            self.server.run_once(timeout_ms=5)

    def stop(self) -> None:
        if self.thread is not None:
            self.server.stop()
            self.thread.join(timeout=10)
            self.thread = None
        else:
            self.server.close()

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def assert_idle_no_leak(self) -> None:
        """Nothing live, nothing pinned, nothing referenced on P; D's reservations all settled."""
        assert self.server.jobs == {} and self.server.senders.pinned_blocks() == []
        assert self.server.pins.num_pinned_blocks == 0
        assert_no_leak(self.server.block_manager)
        assert list(self.decode.rx.table.held_blocks()) == []

    def close(self) -> None:
        self.stop()
        self.decode.close()
        self.gateway.sock.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.fixture
def cluster(request):
    c = Cluster(**getattr(request, "param", {}))
    yield c
    c.close()


def expect_kv(c: Cluster, job: PrefillJob, ref_kv: torch.Tensor) -> None:
    got = c.decode.kv_tokens(job.dst_block_ids, len(job.token_ids) - job.skip_tokens)
    assert torch.equal(got, ref_kv[:, :, job.skip_tokens :])


@pytest.mark.parametrize("cluster", [{"transport": "shm"}, {"transport": "zmq"}], indirect=True)
def test_kv_and_first_token_equal_single_engine(cluster):
    c = cluster
    tokens = prompt(19, seed=1)  # 3 chunks of <= 8, 5 blocks (the last holds 3 tokens)
    ref_kv, ref_token = reference(tokens)
    c.start()
    job = c.decode.job("r1", tokens, logprobs=2)
    c.decode.send(job)
    done = c.decode.wait_event("r1")
    assert done.ok and done.block_ids == tuple(job.dst_block_ids)
    assert done.commit.first_token == ref_token
    first = c.gateway.wait(TokenEvent, lambda e: e.rid == "r1")
    assert (first.index, first.offset, first.token_ids, first.finish_reason) == (0, 0, [ref_token], "")
    assert first.logprobs[0].token_id == ref_token and len(first.logprobs[0].top_ids) == 2
    assert first.logprobs[0].top_ids[0] == ref_token  # greedy: the most likely token
    assert done.commit.first_logprob == pytest.approx(first.logprobs[0].logprob)
    expect_kv(c, job, ref_kv)
    hb = c.gateway.wait(Heartbeat)
    assert (hb.role, hb.address, hb.block_size, hb.kv_blocks_total) == ("prefill", c.server.address, BS, 48)
    c.decode.adopt("r1")
    c.stop()
    assert c.sample("pdserve:prefill_computed_tokens_total") == 19
    nbytes = 5 * c.engine.runner.kv_pool.layout.bytes_per_block
    assert (
        c.decode.registry.get_sample_value("pdserve:kv_transfer_bytes_sum", {"transport": c.decode.transport}) == nbytes
    )
    c.assert_idle_no_leak()


def test_skip_tokens_sends_only_missing_blocks_and_prefix_cache_skips_compute(cluster):
    c = cluster
    tokens = prompt(19, seed=2)
    ref_kv, ref_token = reference(tokens)
    c.start()
    job = c.decode.job("a", tokens, skip=8)  # D holds blocks 0, 1: P sends blocks 2, 3, 4 only
    assert len(job.dst_block_ids) == 3
    c.decode.send(job)
    done = c.decode.wait_event("a")
    assert done.ok and done.commit.first_token == ref_token
    expect_kv(c, job, ref_kv)
    untouched = sorted(c.decode.free)  # every block D did not reserve stays as it was: zeros
    assert torch.equal(
        c.decode.rx.pool.tensor[:, :, untouched], torch.zeros_like(c.decode.rx.pool.tensor[:, :, untouched])
    )
    c.decode.adopt("a")
    # The same prompt again: P's prefix cache holds 4 full blocks (16 tokens), it computes 3 tokens.
    again = c.decode.job("b", tokens, skip=0)
    c.decode.send(again)
    done = c.decode.wait_event("b")
    assert done.ok and done.commit.first_token == ref_token
    expect_kv(c, again, ref_kv)
    c.decode.adopt("b")
    c.stop()
    assert c.sample("pdserve:prefill_computed_tokens_total") == 19 + 3
    assert c.sample("vllm:prefix_cache_hits_total", model_name="") == 16
    c.assert_idle_no_leak()


def test_prompt_logprobs_reach_the_gateway_before_the_first_token(cluster, monkeypatch):
    monkeypatch.setattr("worker.logprob_records.PROMPT_LOGPROBS_PER_FRAME", 8)  # 18 entries: frames of 8, 8, 2
    c = cluster
    tokens = prompt(19, seed=4)
    ref = build(enable_prefix_caching=False)
    ref.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    while not (outs := ref.step()):
        pass
    expected = outs[0].prompt_logprobs[1:]
    c.start()
    c.decode.send(c.decode.job("warm", tokens))  # P's prefix cache now holds the prompt's 4 full blocks
    assert c.decode.wait_event("warm").ok
    c.decode.adopt("warm")
    job = c.decode.job("p", tokens)
    job.sampling.prompt_logprobs = 3
    c.decode.send(job)
    assert c.decode.wait_event("p").ok
    c.gateway.wait(TokenEvent, lambda e: e.rid == "p")
    mine = [r for r in c.gateway.records if getattr(r, "rid", None) == "p"]
    assert [type(r).__name__ for r in mine] == ["PromptLogprobs"] * 3 + ["TokenEvent"]
    assert [f.start for f in mine[:3]] == [0, 8, 16]
    got = [(r, rank) for f in mine[:3] for r, rank in zip(f.logprobs, f.ranks)]
    assert [r.token_id for r, _ in got] == tokens[1:]
    for (r, rank), e in zip(got, expected):
        assert (r.token_id, rank, r.top_ids) == (e.token_id, e.rank, [t for t, _ in e.top])
        assert r.logprob == pytest.approx(e.logprob, abs=1e-5)
    c.decode.adopt("p")
    c.stop()
    assert c.sample("pdserve:prefill_computed_tokens_total") == 19 + 19  # the cached prefix was recomputed
    c.assert_idle_no_leak()


def test_many_jobs_are_batched_and_each_gets_its_own_kv(cluster):
    c = cluster
    prompts = {f"m{i}": prompt(9 + 3 * i, seed=10 + i) for i in range(5)}
    jobs = {rid: c.decode.job(rid, tokens) for rid, tokens in prompts.items()}
    for job in jobs.values():
        c.decode.send(job)
    c.delivered()  # every job is in P's socket queue before the first turn
    steps = 0
    while c.server.jobs or steps == 0:  # the test drives the loop: count the steps
        before = c.sample("pdserve:prefill_computed_tokens_total")
        c.turn()
        steps += c.sample("pdserve:prefill_computed_tokens_total") > before
        assert steps < 50
    total = sum(len(t) for t in prompts.values())
    one_at_a_time = sum(cdiv(len(t), CHUNK) for t in prompts.values())  # 12 steps
    assert cdiv(total, 16) <= steps < one_at_a_time - 4  # chunks of several jobs share each step
    for rid, job in jobs.items():
        done = c.decode.wait_event(rid)
        ref_kv, ref_token = reference(job.token_ids)
        assert done.ok and done.commit.first_token == ref_token
        got = c.decode.kv_tokens(job.dst_block_ids, len(job.token_ids))
        torch.testing.assert_close(got, ref_kv, rtol=0, atol=1e-5)  # batch mix changes matmul shapes
        c.decode.adopt(rid)
    c.assert_idle_no_leak()


def test_abort_while_queued_prefilling_and_transferring_frees_everything(cluster):
    c = cluster
    long_a, long_b = prompt(24, seed=3), prompt(24, seed=4)
    a, b = c.decode.job("a", long_a), c.decode.job("b", long_b)
    c.decode.send(a)
    c.decode.send(b)
    c.delivered()
    c.turn()  # a: 8 tokens, b: 8 tokens (budget 16)
    c.decode.send(c.decode.job("q", prompt(12, seed=5)))
    c.delivered()
    c.turn()
    assert c.server.phase_of("q") is JobPhase.QUEUED and c.server.phase_of("a") is JobPhase.PREFILLING
    c.decode.paused.set()  # D stops answering: b's commit will wait for its ack -> transferring
    time.sleep(0.01)
    c.decode.send(AbortRequest("q", "client gone"))
    c.decode.send(AbortRequest("a", "client gone"))
    c.delivered()
    c.turn()  # aborts arrive first; b computes its last chunk and ships everything, unacked
    assert c.server.phase_of("q") is None and c.server.phase_of("a") is None
    assert c.server.phase_of("b") is JobPhase.TRANSFERRING and c.server.pins.is_pinned("b")
    assert c.server.block_manager.num_in_use_blocks == 6  # only b's pinned blocks
    assert_integrity(c.server.block_manager)
    c.decode.send(AbortRequest("b"))
    c.delivered()
    c.turn()
    c.decode.paused.clear()
    assert c.decode.wait_event("a").reason.startswith("aborted by sender")  # D frees its range at once
    # P shipped b's commit before its Abort. A commit that reached D hands the range over to D for
    # good (D, which is aborting b itself, frees it as the decode node does); an Abort that overtook
    # the commit, with pieces still queued on P, releases it on D at once.
    event = c.decode.wait_event("b")
    if event.ok:
        c.decode.adopt("b")
    else:
        assert event.reason.startswith("aborted by sender"), event
    with c.decode.lock:
        c.decode.rx.abort("q")  # nothing of q reached D: D, which sent the abort, frees its own range
    c.assert_idle_no_leak()
    assert c.sample("pdserve:prefill_jobs_aborted_total") == 3
    assert c.decode.free == set(range(48))  # every reserved range came back on D


@pytest.mark.parametrize("cluster", [{"gateway_timeout_s": 0.5}], indirect=True)
def test_a_lost_gateway_takes_its_jobs_with_it_and_no_other(cluster):
    c = cluster
    c.turn()  # the first heartbeat registers the worker with the (fake) gateway, which acks as gw-a
    c.gateway.wait(Heartbeat)
    c.gateway.sock.send_multipart([b"prefill-test", encode(HeartbeatAck("gw-a"))])
    c.decode.send(dataclasses.replace(c.decode.job("a", prompt(24, seed=3)), gateway_id="gw-a"))
    c.decode.send(dataclasses.replace(c.decode.job("b", prompt(24, seed=4)), gateway_id="gw-b"))
    c.delivered()
    c.turn()  # the ack and both jobs arrive; a and b prefill their first chunks
    assert c.server.phase_of("a") is JobPhase.PREFILLING and c.server.phase_of("b") is JobPhase.PREFILLING
    time.sleep(0.6)  # gw-a acks no heartbeat for longer than the timeout: it is lost
    c.turn()
    assert c.server.phase_of("a") is None and c.server.phase_of("b") is not None
    assert c.decode.wait_event("a").reason.startswith("aborted by sender")  # D's range released at once
    c.turn(6)  # b goes on to its end
    assert c.decode.wait_event("b").ok
    c.decode.adopt("b")
    c.assert_idle_no_leak()
    assert c.sample("pdserve:prefill_jobs_aborted_total") == 1


@pytest.mark.parametrize("cluster", [{"transport": "shm"}, {"transport": "zmq"}], indirect=True)
def test_a_range_the_receiver_released_is_an_abort_not_a_failure(cluster):
    # D dropped the request (its client left) and released the range, but its AbortRequest has not
    # reached P yet: P's first write is refused as stale. That is D's abort arriving another way:
    # counted as one, everything freed here, and no PrefillFailed back to D, which holds nothing.
    c = cluster
    job = c.decode.job("gone", prompt(12, seed=8))
    with c.decode.lock:
        c.decode.rx.abort("gone")
        c.decode.free.update(job.dst_block_ids)
    c.decode.send(job)
    c.delivered()
    c.turn()  # taken, its first chunk computed and shipped
    assert c.sample("pdserve:prefill_jobs_total") == 1
    give_up = time.monotonic() + 10
    while c.server.phase_of("gone") is not None:
        assert time.monotonic() < give_up, c.server.phase_of("gone")
        c.turn()
    assert c.sample("pdserve:prefill_jobs_aborted_total") == 1
    assert c.sample("pdserve:prefill_jobs_rejected_total", reason="transfer") == 0
    assert not c.decode.jobs.poll(300), "a PrefillFailed for a request D already dropped"
    c.assert_idle_no_leak()


@pytest.mark.parametrize("cluster", [{"transport": "shm"}, {"transport": "zmq"}], indirect=True)
def test_a_worker_waiting_on_its_transfer_sleeps_on_the_receivers_socket(cluster):
    # Nothing to compute, a transfer out: the loop sleeps until the receiver answers, instead of
    # looking every millisecond (it used to: ~1000 turns a second on a core the decode worker shares).
    c = cluster
    turns = []
    run_once = c.server.run_once

    def counted(timeout_ms=None):
        turns.append(time.monotonic())
        run_once(timeout_ms)

    c.server.run_once = counted
    c.decode.paused.set()  # no Credit, no CommitAck until it resumes
    c.start()
    c.decode.send(c.decode.job("w", prompt(12, seed=9)))
    give_up = time.monotonic() + 10
    while c.server.phase_of("w") is not JobPhase.TRANSFERRING:
        assert time.monotonic() < give_up
        time.sleep(0.005)
    before = len(turns)
    time.sleep(0.5)
    assert len(turns) - before <= 0.5 / (c.server.options.idle_poll_ms / 1000) + 5
    c.decode.paused.clear()  # its answers wake the loop, which finishes the job
    assert c.decode.wait_event("w").ok
    while c.server.phase_of("w") is not None:
        assert time.monotonic() < give_up
        time.sleep(0.005)
    c.decode.adopt("w")
    c.stop()
    c.assert_idle_no_leak()


@pytest.mark.parametrize("cluster", [{"handshake_timeout_s": 3.0}], indirect=True)
def test_unreachable_receiver_fails_its_jobs_without_stalling_the_others(cluster):
    # A handshake used to block the loop for up to its timeout, once per job for a dead receiver:
    # a decode worker killed with several jobs queued here froze this worker for many seconds.
    c = cluster
    probe = make_socket(c.ctx, zmq.ROUTER)
    dead_address = bind(probe, "127.0.0.1")
    probe.close(linger=0)  # nothing listens there any more

    def dead_job(rid: str) -> PrefillJob:
        tokens = prompt(12, seed=6)
        return PrefillJob(
            rid,
            tokens,
            0,
            [0, 1, 2],
            1,
            dead_address,
            True,
            SamplingSpec(max_tokens=4, temperature=0.0),
            time.time() + 30,
        )

    c.start()
    c.decode.send(dead_job("dead-1"))
    c.decode.send(dead_job("dead-2"))
    c.decode.send(c.decode.job("live", prompt(12, seed=7)))
    assert c.decode.wait_event("live").ok  # computed and committed while the other handshake waits
    assert c.server.phase_of("dead-1") is JobPhase.QUEUED
    failed = [c.decode.recv_failed(), c.decode.recv_failed()]
    assert [f.culprit for f in failed] == ["decode"] * 2  # its KV receiver did not answer: D's fault
    failures = {f.rid: f.reason for f in failed}
    assert failures.keys() == {"dead-1", "dead-2"}
    assert all(r.startswith(f"handshake with {dead_address} failed: ") for r in failures.values())
    c.decode.send(dead_job("dead-3"))  # right after a failed handshake: fails at once, no new wait
    started = time.monotonic()
    assert c.decode.recv_failed(timeout_ms=10000).rid == "dead-3" and time.monotonic() - started < 1.5
    assert c.sample("pdserve:kv_handshakes_total", result="failed") == 1
    c.decode.adopt("live")
    c.assert_idle_no_leak()


def test_malformed_frames_and_bad_jobs_are_rejected_and_counted(cluster):
    c = cluster
    c.start()
    c.decode.jobs.send(b"\xc1 not msgpack")
    c.decode.jobs.send_multipart([b"one", b"two"])
    c.decode.send(Goodbye("who"))  # a valid record of the wrong kind
    tokens = prompt(10, seed=6)
    bad_vocab = c.decode.job("v", tokens[:-1] + [768])
    c.decode.send(bad_vocab)
    failed = c.decode.recv_failed()
    assert failed.reason == "prompt token id 768 is outside this model's vocabulary of 768 tokens"
    assert failed.culprit == "decode"  # it sent a job no prefill worker can run
    bad_bias = c.decode.job("b", tokens)
    bad_bias.sampling.logit_bias = [TokenBias(768, 1.0)]
    c.decode.send(bad_bias)
    assert c.decode.recv_failed().reason == "logit_bias token id 768 is outside this model's vocabulary of 768 tokens"
    bad_dst = c.decode.job("d", tokens)
    bad_dst.dst_block_ids = bad_dst.dst_block_ids[:-1]
    c.decode.send(bad_dst)
    failed = c.decode.recv_failed()
    assert failed.rid == "d" and "2 destination blocks for tokens [0, 10); expected 3" in failed.reason
    late = c.decode.job("late", tokens, deadline_s=-1.0)
    c.decode.send(late)
    failed = c.decode.recv_failed()
    assert failed.reason.startswith("deadline passed") and failed.culprit == "none"
    good = c.decode.job("g", tokens)
    c.decode.send(good)
    assert c.decode.wait_event("g").ok  # still serving
    c.decode.adopt("g")
    for rid in ("v", "b", "d", "late"):
        c.decode.rx.abort(rid)
    # D has the Commit; P ends the job on D's CommitAck, on its own thread: wait for that, not a time.
    give_up = time.monotonic() + 60
    while "g" in c.server.jobs and time.monotonic() < give_up:
        time.sleep(0.01)
    c.stop()
    assert c.sample("pdserve:prefill_malformed_frames_total") == 3
    assert c.sample("pdserve:prefill_jobs_rejected_total", reason="bad_job") == 4
    c.assert_idle_no_leak()


def test_metrics_health_ready_and_drain(cluster):
    c = cluster
    http = serve_http("127.0.0.1", 0, c.metrics.registry, c.server.is_ready)
    try:
        c.start()
        job = c.decode.job("x", prompt(11, seed=7))
        c.decode.send(job)
        assert c.decode.wait_event("x").ok
        c.decode.adopt("x")
        base = f"http://127.0.0.1:{http.port}"
        body = urllib.request.urlopen(f"{base}/metrics").read().decode()
        for series in (
            "pdserve:prefill_jobs_total 1.0",
            "pdserve:kv_blocks_total 48.0",
            'vllm:prefix_cache_queries_total{model_name=""} 11.0',
            "pdserve:kv_handshakes_total",
        ):
            assert series in body, series
        assert urllib.request.urlopen(f"{base}/health").status == 200
        assert urllib.request.urlopen(f"{base}/ready").status == 200
        c.server.request_drain()
        c.gateway.wait(Goodbye, lambda g: g.worker_id == "prefill-test")
        assert c.gateway.wait(Heartbeat, lambda h: h.draining).queued_prefill_tokens == 0
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/ready")
        assert err.value.code == 503
        c.thread.join(timeout=10)
        assert not c.thread.is_alive()  # a finished drain ends the loop
    finally:
        http.close()
    c.assert_idle_no_leak()


def test_a_grammar_compiles_off_the_loop_while_other_jobs_prefill(cluster):
    """A structured output's job waits for its grammar (held here until the test lets it go) without
    holding up the job behind it; its first token is then the grammar's, as a single engine samples it;
    a grammar that does not compile fails its job with the reason."""
    from engine.llm import LLM
    from protocol.serving import StructuredOutput

    c, regex = cluster, StructuredOutput("regex", "(ab|cd){2,6}")
    grammars = c.engine.grammars
    gate, compile_now = threading.Event(), grammars.guide
    grammars.guide = lambda spec: gate.wait(60) and compile_now(spec)
    tokens, other = prompt(19, seed=5), prompt(11, seed=6)
    [expected] = (
        LLM(model_path(), block_size=BS)
        .generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, structured_output=regex))[0]
        .outputs[0]
        .token_ids
    )
    c.start()

    def job(rid: str, ids: list[int], spec: StructuredOutput) -> PrefillJob:
        dst = c.decode.reserve(rid, 1, cdiv(len(ids), BS))
        return PrefillJob(
            rid,
            ids,
            0,
            dst,
            1,
            c.decode.server.endpoint,
            True,
            SamplingSpec(max_tokens=4, temperature=0.0, structured_output=spec),
            time.time() + 30,
        )

    c.decode.send(job("guided", tokens, regex))
    c.decode.send(c.decode.job("plain", other))
    assert c.decode.wait_event("plain").ok  # prefilled and sent while the grammar is held
    assert c.server.jobs["guided"].phase == JobPhase.QUEUED
    c.decode.adopt("plain")
    gate.set()
    done = c.decode.wait_event("guided")
    assert done.ok and done.commit.first_token == expected
    c.decode.adopt("guided")
    c.decode.send(job("bad", other, StructuredOutput("regex", "a(b")))
    failed = c.decode.recv_failed()
    assert failed.rid == "bad" and failed.reason.startswith("invalid regex: Regex parsing error at position 4")
    assert failed.culprit == "prefill"  # the decode worker compiled it first: only this node failed it
    c.decode.rx.abort("bad")  # as the decode worker does on PrefillFailed
    c.stop()
    assert c.sample("pdserve:prefill_jobs_rejected_total", reason="bad_job") == 1
    c.assert_idle_no_leak()


def test_a_job_from_a_receiver_incarnation_that_is_gone_fails_at_once_and_the_next_one_serves(cluster):
    # A job names D's receiver incarnation (a D restarted in place keeps its address). One that names an
    # incarnation the receiver no longer is (its D died after sending it) costs one handshake to find
    # out, fails with the reason, and leaves the jobs of the live incarnation exact.
    c = cluster
    tokens = prompt(11, seed=31)
    ref_kv, ref_token = reference(tokens)
    c.start()
    stale = c.decode.job("old", tokens)
    stale.kv_incarnation = "a-process-that-died"
    c.decode.send(stale)
    failed = c.decode.recv_failed()
    assert failed.rid == "old" and "the job's receiver incarnation a-process-that-d is gone" in failed.reason
    assert c.sample("pdserve:kv_handshakes_total", result="receiver_restarted") == 1
    with c.decode.lock:
        c.decode.rx.abort("old")  # as the decode worker does on PrefillFailed
    for rid in ("new-1", "new-2"):
        job = c.decode.job(rid, tokens)
        job.kv_incarnation = c.decode.rx.incarnation
        c.decode.send(job)
        done = c.decode.wait_event(rid)
        assert done.ok and done.commit.first_token == ref_token
        expect_kv(c, job, ref_kv)
        c.decode.adopt(rid)
    assert c.sample("pdserve:kv_handshakes_total", result="receiver_restarted") == 1  # no more handshakes
    c.stop()
    c.assert_idle_no_leak()
