"""A live worker is never dropped for a slow step; a wedged one is taken out of rotation. The real gateway
backend (ZmqBackend, its registry and expiry loop) and a real decode worker of this process (its loop on
a thread, the tiny model), whose engine step is made to block on an Event:

- a step that blocks for many times the gateway's worker timeout: the worker's heartbeats go on (from
  its liveness thread), it stays registered, and its request completes with the engine's exact tokens
  once the step returns;
- a step that does not return: past ``step_timeout_s`` the worker is stuck (listed, not accepting), its
  request fails with an error that says so, and it is back in rotation once the step ends; nothing leaks.

No sleeps decide anything: each phase waits for the condition it needs, with generous bounds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from decode_node.node import DecodeNode
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from gateway.metrics import GatewayMetrics
from gateway.workers.backend import GenerationRequest
from gateway.workers.registry import WorkerRegistry
from gateway.workers.router import Policy, RouterParams
from gateway.workers.zmq_backend import ZmqBackend, ZmqBackendParams
from protocol.serving import Heartbeat, SamplingSpec
from tests.decode_harness import decode_config
from tests.invariants import assert_no_leak

HEARTBEAT_S = 0.2  # the workers' (tests/decode_harness.py decode_config)
MAX_MISSED = 3  # the gateway drops a worker silent for 0.6 s
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 77]
SAMPLING = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


class StepGate:
    """Wraps the runner's ``execute``: while armed, the next step blocks until ``release``."""

    def __init__(self, runner) -> None:
        self._execute = runner.execute
        self.armed = False
        self.entered = threading.Event()
        self._released = threading.Event()
        runner.execute = self

    def __call__(self, batch):
        if self.armed:
            self.armed = False
            self.entered.set()
            self._released.wait()
        return self._execute(batch)

    def release(self) -> None:
        self._released.set()


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, what
        await asyncio.sleep(0.02)


async def complete(backend: ZmqBackend, rid: str) -> tuple[list[int], str | None]:
    """(the tokens, the error) of one request to the backend."""
    request = GenerationRequest(
        rid, list(PROMPT), SamplingSpec(**SAMPLING), time.monotonic(), deadline=time.monotonic() + 120
    )
    tokens: list[int] = []
    async for event in backend.generate(request):
        if event.error:
            return tokens, event.error
        tokens += event.token_ids
    return tokens, None


class Cluster:
    """The gateway backend in this event loop, one decode worker ("d0") on a thread."""

    def __init__(self, step_timeout_s: float) -> None:
        self.registry = WorkerRegistry(HEARTBEAT_S, MAX_MISSED, step_timeout_s=step_timeout_s)
        self.metrics = GatewayMetrics()
        router = RouterParams(block_size=4, policy=Policy.PREFIX, local_prefill_max_tokens=256)
        self.backend = ZmqBackend(
            self.registry, self.metrics, ZmqBackendParams("127.0.0.1", 0, router, expiry_interval_s=0.05)
        )
        self.ctx = zmq.Context()

    async def start(self) -> None:
        await self.backend.start()
        self.config = decode_config(self.backend.address)
        assert self.config.gateway.worker_heartbeat_s == HEARTBEAT_S
        self.node = DecodeNode.start(self.config, self.ctx)
        self.gate = StepGate(self.node.server.engine.runner)
        self.loop = threading.Thread(target=self.node.server.run, daemon=True)
        self.loop.start()
        await until(lambda: self.registry.get("d0") is not None, "d0 did not register")

    def count(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    async def stop(self) -> None:
        self.gate.release()
        await self.backend.stop()
        self.node.server.stop()
        self.loop.join(timeout=30)
        bm = self.node.server.block_manager
        self.node.close()
        self.ctx.destroy(linger=0)
        assert_no_leak(bm)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    config = decode_config("tcp://127.0.0.1:9")
    return LLM(config.model.path, config=config).generate([PROMPT], SamplingParams(**SAMPLING))[0].outputs[0].token_ids


def test_a_step_far_longer_than_the_worker_timeout_keeps_the_worker_and_its_request(expected):
    async def scenario() -> None:
        cluster = Cluster(step_timeout_s=600.0)
        await cluster.start()
        try:
            cluster.gate.armed = True
            request = asyncio.create_task(complete(cluster.backend, "slow"))
            await until(cluster.gate.entered.is_set, "the request's step did not start")
            silence = cluster.registry.timeout_s
            # The step has now run five times the silence after which the worker would be dropped:
            # heartbeats came all along (their step age says so), and the worker is still there.
            await until(
                lambda: cluster.registry.get("d0").heartbeat.step_running_s > 5 * silence,
                "no heartbeat during the step",
            )
            info = cluster.registry.get("d0")
            assert not info.is_stuck and [w.worker_id for w in cluster.registry.accepting(info.role)] == ["d0"]
            assert cluster.count("pdserve:workers_lost_total", {"reason": "expired"}) == 0
            cluster.gate.release()
            assert await request == (expected, None)
            assert cluster.count("pdserve:workers_stuck_total") == 0
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_step_that_never_returns_takes_the_worker_out_of_rotation_with_a_clear_error(expected):
    async def scenario() -> None:
        cluster = Cluster(step_timeout_s=3.0)  # well past any normal step of the tiny model, even loaded
        await cluster.start()
        try:
            assert await complete(cluster.backend, "warm") == (expected, None)  # first steps done, quick
            cluster.gate.armed = True
            tokens, error = await complete(cluster.backend, "wedged")
            assert cluster.gate.entered.is_set() and tokens == []
            assert error is not None and "worker d0 is stuck: one step has run for" in error
            assert "gateway.worker_step_timeout_s is 3 s" in error
            info = cluster.registry.get("d0")  # still registered: its heartbeats kept coming
            assert info is not None and info.is_stuck and info.as_json()["stuck"] is True
            assert not cluster.backend.is_ready()  # no decode worker takes new requests
            assert cluster.count("pdserve:workers_stuck_total") == 1
            assert cluster.count("pdserve:workers_lost_total", {"reason": "expired"}) == 0
            assert cluster.count("pdserve:worker_failures_total", {"worker_id": "d0"}) == 1
            cluster.gate.release()  # the step ends: the worker frees the aborted request, and is back
            await until(lambda: not cluster.registry.get("d0").is_stuck, "d0 did not come back")
            await until(lambda: not cluster.node.server.requests, "d0 still holds the aborted request")
            assert cluster.backend.is_ready()
            assert await complete(cluster.backend, "after") == (expected, None)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_prefill_worker_in_a_blocked_step_heartbeats_on_and_its_job_completes_exactly():
    """The prefill worker's loop has the same liveness thread: a step that blocks for five heartbeat
    intervals shows in its heartbeats (same step count, a growing step age), and the job then ends with
    the single engine's KV and first token."""
    from tests.test_prefill_node import Cluster as PrefillCluster
    from tests.test_prefill_node import expect_kv, prompt, reference

    c = PrefillCluster(transport="zmq")
    gate = StepGate(c.server.runner)
    try:
        tokens = prompt(19, seed=7)
        ref_kv, ref_token = reference(tokens)
        c.start()
        gate.armed = True
        job = c.decode.job("slow", tokens)
        c.decode.send(job)
        assert gate.entered.wait(timeout=60), "the job's step did not start"
        hb = c.gateway.wait(Heartbeat, lambda hb: hb.step_running_s > 5 * 0.2, timeout=60)
        # the loop's last heartbeat, from before the step took the job in: its load as last reported
        assert hb.num_running == 0 and c.server.liveness.num_sent_by_thread >= 1
        during = [h.steps_completed for h in c.gateway.records if isinstance(h, Heartbeat) and h.step_running_s > 0.5]
        assert len(set(during)) == 1  # one step, however many heartbeats
        gate.release()
        done = c.decode.wait_event("slow", timeout=60)
        assert done.ok and done.commit.first_token == ref_token
        expect_kv(c, job, ref_kv)
        c.decode.adopt("slow")
        c.stop()
        c.assert_idle_no_leak()
    finally:
        gate.release()
        c.close()
