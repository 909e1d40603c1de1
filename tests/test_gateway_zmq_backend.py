"""The real ZeroMQ backend against fake workers that are real DEALER sockets speaking protocol/serving.py.

A fake decode worker answers Generate with a deterministic token stream per completion (or Busy, or goes
silent, or wedges: heartbeats go on while its step never ends); a fake prefill worker sends the first token (offset 0) when the fake decode worker hands it the
request, AFTER the decode worker's own events, so the gateway must put them back in order.
"""

from __future__ import annotations

import threading
import time
import zlib

import httpx
import msgpack
import openai
import pytest
import zmq

from gateway.http.app import GatewayParams, build_app
from gateway.metrics import GatewayMetrics
from gateway.serving.pipeline import ServingLimits
from gateway.text.tokenizer import Tokenizer
from gateway.workers.registry import WorkerRegistry
from gateway.workers.router import Policy, RouterParams
from gateway.workers.zmq_backend import ZmqBackend, ZmqBackendParams
from protocol.codec import decode, encode
from protocol.serving import (
    AbortRequest,
    Busy,
    Generate,
    Goodbye,
    Heartbeat,
    PromptLogprobs,
    TokenEvent,
    TokenLogprobRecord,
)
from tests.fake_backend import MODEL, OUTPUT_TEXT, LiveServer, wait_until

HEARTBEAT_S = 0.1
STEP_TIMEOUT_S = 1.0  # a worker's step running longer makes it stuck
OTHER_TEXT = "A cat sat on the mat."


class FakeWorker:
    """One worker process, reduced to its socket: heartbeats, and scripted answers to Generate."""

    def __init__(
        self,
        address: str,
        worker_id: str,
        role: str = "decode",
        mode: str = "tokens",
        outputs: list[list[int]] | None = None,
        token_delay_s: float = 0.0,
        peer: FakeWorker | None = None,
        kv_blocks_in_use: int = 0,
        culprit: str = "",
    ) -> None:
        self.worker_id, self.role, self.mode = worker_id, role, mode
        # its own endpoint (never dialed), one per worker id
        self.address = f"tcp://127.0.0.1:{7000 + zlib.crc32(worker_id.encode()) % 1000}"
        self.outputs = outputs or []
        self.token_delay_s = token_delay_s
        self.peer = peer  # the prefill worker a disaggregated Generate names
        self.kv_blocks_in_use = kv_blocks_in_use
        self.culprit = culprit  # mode "fail": whom its error events blame; a prefill worker fails its first token
        self.received: list = []
        self.incarnation = "inc-1"
        self.is_heartbeating = True
        self.step_started_at: float | None = None  # mode "wedge": the step that never ends began then
        self._outbox: list[tuple[float, object]] = []  # (due time, record)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gateway = address
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def schedule(self, delay_s: float, record) -> None:
        with self._lock:
            self._outbox.append((time.monotonic() + delay_s, record))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            self.worker_id,
            self.role,
            self.address,
            self.incarnation,
            block_size=4,
            kv_blocks_total=1000,
            kv_blocks_free=1000 - self.kv_blocks_in_use,
            kv_blocks_in_use=self.kv_blocks_in_use,
            num_running=1,
            num_waiting=2,
            queued_prefill_tokens=0,
            steps_completed=0 if self.step_started_at is not None else 1,
            step_running_s=time.monotonic() - self.step_started_at if self.step_started_at is not None else 0.0,
        )

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._gateway)
        next_heartbeat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.is_heartbeating and now >= next_heartbeat:
                sock.send(encode(self._heartbeat()))
                next_heartbeat = now + HEARTBEAT_S
            with self._lock:
                due = [r for t, r in self._outbox if t <= now]
                self._outbox = [(t, r) for t, r in self._outbox if t > now]
            for record in due:
                sock.send(encode(record))
            if sock.poll(5):
                record = decode(sock.recv())
                self.received.append(record)
                self._handle(record)
        sock.close()
        ctx.term()

    def _handle(self, record) -> None:
        if isinstance(record, AbortRequest):
            with self._lock:
                self._outbox = [(t, r) for t, r in self._outbox if r.rid != record.rid]
        elif isinstance(record, Generate) and self.mode == "busy":
            self.schedule(0, Busy(record.rid, "no free KV blocks"))
        elif isinstance(record, Generate) and self.mode == "die":
            self.is_heartbeating = False  # gone silent, as a crashed process is
        elif isinstance(record, Generate) and self.mode == "wedge":
            self.step_started_at = time.monotonic()  # alive (heartbeats go on), its step never ends
        elif isinstance(record, Generate) and self.mode == "fail" and (g := record).prefill_address:
            self.schedule(0, TokenEvent(g.rid, 0, 0, [], error="the KV never came", culprit=self.culprit))
        elif isinstance(record, Generate) and self.mode == "refuse":
            self.schedule(0, TokenEvent(record.rid, 0, 0, [], error="grammar does not compile", refused=True))
        elif isinstance(record, Generate) and self.mode == "restart":
            # Killed and started again in place: the request is lost, the new process serves the next.
            self.incarnation, self.mode = "inc-2", "tokens"
        elif isinstance(record, Generate):
            self._stream(record)

    def _stream(self, g: Generate) -> None:
        disaggregated = g.prefill_address != ""
        if disaggregated:
            assert self.peer is not None and g.prefill_address == self.peer.address
        if g.sampling.prompt_logprobs is not None:  # from whoever computes the prompt, before its first token
            (self.peer if disaggregated else self).schedule(0, prompt_logprobs_frame(g.rid, g.token_ids, self.mode))
        for j in range(g.sampling.n):
            ids = self.outputs[j][: g.sampling.max_tokens]
            finish = "length" if len(ids) < len(self.outputs[j]) else "stop"
            start = 1 if disaggregated else 0
            for k in range(start, len(ids)):
                self.schedule(
                    self.token_delay_s * k,
                    TokenEvent(
                        g.rid,
                        j,
                        k,
                        [ids[k]],
                        finish_reason=finish if k == len(ids) - 1 else "",
                        num_cached_tokens=0 if k == start else -1,
                    ),
                )
            if disaggregated and self.peer.mode == "fail":  # before D's first event
                self.peer.schedule(0, TokenEvent(g.rid, j, 0, [], error="out of memory", culprit=self.peer.culprit))
            elif disaggregated:  # P's first token lands after D's events: the gateway reorders
                self.peer.schedule(0.05, TokenEvent(g.rid, j, 0, [ids[0]]))


def prompt_logprobs_frame(rid: str, prompt: list[int], mode: str) -> PromptLogprobs:
    """Prompt token p + 1 gets logprob -p / 10, rank p + 1, and one top entry: token 7. Mode "gap" claims
    the frame starts at entry 1, leaving entry 0 unsent; mode "surplus" sends one entry more than the prompt has."""
    entries = [TokenLogprobRecord(t, -p / 10, [7], [-0.01]) for p, t in enumerate(prompt[1:])]
    if mode == "surplus":
        entries.append(TokenLogprobRecord(7, -1.0, [7], [-0.01]))
    return PromptLogprobs(rid, 1 if mode == "gap" else 0, entries, list(range(1, len(entries) + 1)))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return Tokenizer(tok_dir)


@pytest.fixture
def gateway(tok_dir, tokenizer):
    registry = WorkerRegistry(heartbeat_interval_s=HEARTBEAT_S, max_missed=3, step_timeout_s=STEP_TIMEOUT_S)
    metrics = GatewayMetrics()
    params = ZmqBackendParams(
        "127.0.0.1",
        0,
        RouterParams(block_size=4, policy=Policy.PREFIX, local_prefill_max_tokens=4),
        queue_timeout_s=0.3,
        retry_after_s=4,
        expiry_interval_s=0.05,
    )
    backend = ZmqBackend(registry, metrics, params)
    limits = ServingLimits(MODEL, max_model_len=128, retry_after_s=2, request_timeout_s=10.0)
    app = build_app(GatewayParams(tokenizer, backend, limits, registry=registry, metrics=metrics))
    workers: list[FakeWorker] = []
    with LiveServer(app, lifespan="on") as server:
        server.backend = backend
        server.workers = workers
        server.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

        def add(worker_id, **kw) -> FakeWorker:
            kw.setdefault(
                "outputs",
                [
                    tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False),
                    tokenizer.encode(OTHER_TEXT, add_special_tokens=False),
                ],
            )
            w = FakeWorker(backend.address, worker_id, **kw)
            workers.append(w)
            wait_until(lambda: registry.get(worker_id) is not None, f"{worker_id} did not register")
            return w

        server.add = add
        yield server
        for w in workers:
            w.close()


def metric(base_url: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in httpx.get(base_url + "/metrics").text.splitlines()
        if line.startswith(name + " ")
    )


def worker_ids(base_url: str) -> list[str]:
    return [w["id"] for w in httpx.get(base_url + "/v1/workers").json()["data"]]


def generates(worker: FakeWorker) -> list[Generate]:
    return [r for r in worker.received if isinstance(r, Generate)]


def test_heartbeat_registers_and_silence_expires(gateway):
    d1 = gateway.add("d1")
    gateway.add("p1", role="prefill")
    listed = httpx.get(gateway.base_url + "/v1/workers").json()["data"]
    assert [(w["id"], w["role"], w["address"], w["load"]["num_waiting"]) for w in listed] == [
        ("d1", "decode", d1.address, 2),
        ("p1", "prefill", gateway.workers[1].address, 2),
    ]
    assert metric(gateway.base_url, 'pdserve:pool_workers{role="decode"}') == 1
    assert metric(gateway.base_url, 'pdserve:pool_num_requests_waiting{role="prefill"}') == 2
    assert httpx.get(gateway.base_url + "/ready").status_code == 200
    d1.is_heartbeating = False
    # Expiry comes after 3 missed heartbeats; the generous deadline only bounds a loaded machine.
    wait_until(lambda: worker_ids(gateway.base_url) == ["p1"], "silent worker was not dropped", timeout_s=15)
    assert metric(gateway.base_url, 'pdserve:workers_lost_total{reason="expired"}') == 1
    assert metric(gateway.base_url, 'pdserve:pool_workers{role="decode"}') == 0
    assert httpx.get(gateway.base_url + "/ready").status_code == 503


def test_goodbye_removes_at_once_and_draining_gets_nothing(gateway, tokenizer):
    d1 = gateway.add("d1")
    d2 = gateway.add("d2")
    d1.is_heartbeating = False  # drained: it says goodbye, long before it would expire
    d1.schedule(0, Goodbye("d1"))
    wait_until(lambda: worker_ids(gateway.base_url) == ["d2"], "goodbye did not remove the worker", timeout_s=15)
    # Removed by its goodbye, not by the silence that followed (which the counter would call "expired").
    assert metric(gateway.base_url, 'pdserve:workers_lost_total{reason="goodbye"}') == 1
    assert metric(gateway.base_url, 'pdserve:workers_lost_total{reason="expired"}') == 0
    d2_hb = d2._heartbeat()
    d2_hb.draining = True
    d2.is_heartbeating = False
    d2.schedule(0, d2_hb)
    wait_until(lambda: gateway.backend.is_ready() is False, "draining worker still takes requests")
    with pytest.raises(openai.APIStatusError) as info:
        gateway.client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert info.value.status_code == 503 and generates(d2) == []


def test_completion_and_stream_local_prefill(gateway, tokenizer):
    d1 = gateway.add("d1")
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT and r.choices[0].finish_reason == "stop"
    (g,) = generates(d1)
    assert g.prefill_address == "" and g.token_ids == tokenizer.encode("Hi") and g.sampling.max_tokens == 100
    assert g.deadline == pytest.approx(time.time() + 10, abs=2)
    chunks = list(gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True))
    ids = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:3]
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(ids)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="local"}') == 2


def test_disaggregated_first_token_from_prefill_is_put_in_order(gateway, tokenizer):
    p1 = gateway.add("p1", role="prefill")
    d1 = gateway.add("d1", peer=p1)
    prompt = "The quick brown fox jumps over the lazy dog."  # > 4 uncached tokens: prefill on P
    chunks = list(gateway.client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == OUTPUT_TEXT
    (g,) = generates(d1)
    assert g.prefill_address == p1.address
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="disaggregated"}') == 1
    assert gateway.backend._router._sent_prefill_tokens == {}  # off P's backlog once the first token came


def test_n2_is_one_generate_routed_by_index(gateway):
    d1 = gateway.add("d1")
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, OUTPUT_TEXT), (1, OTHER_TEXT)]
    (g,) = generates(d1)
    assert g.sampling.n == 2


def served_by_the_second(gateway, mode: str) -> tuple[FakeWorker, FakeWorker]:
    """d1 (in ``mode``) and d2: d1, the lowest id, is the first choice on a tie; the request is served
    by d2 after d1 had it once."""
    d1 = gateway.add("d1", mode=mode)
    d2 = gateway.add("d2")
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT
    assert len(generates(d1)) == 1 and len(generates(d2)) == 1
    return d1, d2


def test_busy_goes_to_another_decode_worker_and_all_busy_is_503(gateway):
    _, d2 = served_by_the_second(gateway, "busy")
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="busy"}') == 1
    d2.mode = "busy"
    r = httpx.post(gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Yo", "max_tokens": 5})
    assert r.status_code == 503 and r.headers["Retry-After"] == "4"
    assert "every decode worker is busy" in r.json()["error"]["message"]


def test_no_worker_is_503_with_retry_after(gateway):
    r = httpx.post(gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    assert r.status_code == 503 and r.headers["Retry-After"] == "2"
    assert r.json()["error"]["code"] == "no_capacity"


def test_full_pool_waits_in_the_queue_then_503(gateway):
    gateway.add("d1", kv_blocks_in_use=1000)  # registered, but no KV room
    t0 = time.monotonic()
    r = httpx.post(gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    assert r.status_code == 503 and r.headers["Retry-After"] == "4"
    assert time.monotonic() - t0 >= 0.3  # waited the queue timeout for room first
    assert "KV room" in r.json()["error"]["message"]


def test_client_disconnect_aborts_decode_and_prefill(gateway):
    p1 = gateway.add("p1", role="prefill")
    d1 = gateway.add("d1", peer=p1, token_delay_s=0.1)
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", gateway.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    (g,) = generates(d1)
    for w in (d1, p1):
        wait_until(
            lambda: any(isinstance(x, AbortRequest) and x.rid == g.rid for x in w.received),
            f"{w.worker_id} got no AbortRequest",
        )
    assert gateway.backend._router._sent_prefill_tokens == {}


@pytest.mark.parametrize("disaggregated", [False, True])
def test_prompt_logprobs_frames_reach_the_response(gateway, tokenizer, disaggregated):
    p1 = gateway.add("p1", role="prefill") if disaggregated else None
    gateway.add("d1", peer=p1)
    prompt = "The quick brown fox jumps over the lazy dog."  # > 4 tokens: prefilled on P when there is one
    ids = tokenizer.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    r = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p, (entry, token) in enumerate(zip(got[1:], ids[1:])):
        assert entry[str(token)]["logprob"] == pytest.approx(-p / 10) and entry[str(token)]["rank"] == p + 1
        assert entry["7"]["rank"] == 1 or token == 7


@pytest.mark.parametrize("mode", ["gap", "surplus"])
def test_prompt_logprobs_frames_out_of_line_fail_the_request_and_are_counted(gateway, mode):
    gateway.add("d1", mode=mode)
    body = {"model": MODEL, "prompt": "Hi there", "max_tokens": 2, "prompt_logprobs": 0}
    r = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert "worker sent no prompt logprobs" in r.json()["error"]["message"]
    assert metric(gateway.base_url, "pdserve:worker_malformed_frames_total") == 1
    assert gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100).choices[0].text == OUTPUT_TEXT


def test_malformed_frames_are_counted_and_ignored(gateway):
    gateway.add("d1")
    ctx = zmq.Context()
    junk = ctx.socket(zmq.DEALER)
    junk.setsockopt(zmq.LINGER, 0)
    junk.setsockopt(zmq.IDENTITY, b"junk")
    junk.connect(gateway.backend.address)
    junk.send(b"\xc1 not msgpack")
    junk.send(encode(AbortRequest("x")))  # a valid record, but not one a worker sends
    junk.send_multipart([b"a", b"b"])
    hb = Heartbeat("d1", "decode", "tcp://evil", "inc-9", 4, 10, 10, 0, 0, 0, 0)
    junk.send(encode(hb))  # claims another worker's id, which is bound to d1's live connection
    wire = msgpack.unpackb(encode(Heartbeat("junk", "decode", "tcp://127.0.0.1:9", "inc", 4, 10, 10, 0, 0, 0, 0)))
    wire[1]["step_running_s"] = float("nan")  # a step age no worker can have: not a way to look busy forever
    junk.send(msgpack.packb(wire))
    wait_until(
        lambda: metric(gateway.base_url, 'pdserve:rejected_frames_total{reason="identity_taken"}') == 1,
        "identity takeover not refused",
    )
    wait_until(lambda: metric(gateway.base_url, "pdserve:worker_malformed_frames_total") == 4, "NaN step age taken")
    assert metric(gateway.base_url, 'pdserve:rejected_frames_total{reason="malformed"}') == 4
    assert gateway.backend._registry.get("junk") is None
    assert gateway.backend._registry.get("d1").incarnation == "inc-1"
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT
    junk.close()
    ctx.term()


def test_worker_dying_before_first_token_is_retried_once_elsewhere(gateway):
    d1 = gateway.add("d1", mode="die")
    d2 = gateway.add("d2")
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT
    assert len(generates(d1)) == 1 and len(generates(d2)) == 1
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="retry"}') == 1
    assert worker_ids(gateway.base_url) == ["d2"]


def test_a_request_lost_to_a_restart_is_retried_on_the_restarted_worker(gateway):
    # The only decode worker restarts in place (same id, new incarnation) with the request in it:
    # the new process is a new worker, and takes the retry.
    d1 = gateway.add("d1", mode="restart")
    r = gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT
    assert len(generates(d1)) == 2
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="retry"}') == 1
    assert gateway.backend._registry.get("d1").incarnation == "inc-2"


def test_retries_before_the_first_token_are_bounded(gateway):
    workers = [gateway.add(f"d{i}", mode="die") for i in range(4)]
    with pytest.raises(openai.APIStatusError) as failed:
        gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert failed.value.status_code >= 500 and failed.value.body["message"]
    assert sum(len(generates(w)) for w in workers) == 3  # the first attempt and two retries, no more
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="retry"}') == 2


def test_a_wedged_worker_is_taken_out_of_rotation_and_its_request_retried_elsewhere(gateway):
    d1, d2 = served_by_the_second(gateway, "wedge")
    (g,) = generates(d1)
    wait_until(
        lambda: any(isinstance(r, AbortRequest) and r.rid == g.rid and "is stuck" in r.reason for r in d1.received),
        "the wedged worker was not told to drop the request (for when its step ends)",
    )
    listed = {w["id"]: w for w in httpx.get(gateway.base_url + "/v1/workers").json()["data"]}
    # as its last heartbeat said: one step under way (that heartbeat's age plus the time since passed the timeout)
    assert listed["d1"]["stuck"] is True and listed["d1"]["steps_completed"] == 0
    assert 0 < listed["d1"]["step_running_s"] <= gateway.backend._registry.get("d1").step_age(time.monotonic())
    assert listed["d2"]["stuck"] is False
    assert metric(gateway.base_url, "pdserve:workers_stuck_total") == 1
    assert metric(gateway.base_url, 'pdserve:workers_lost_total{reason="expired"}') == 0
    assert metric(gateway.base_url, 'pdserve:worker_failures_total{worker_id="d1"}') == 1
    gateway.client.completions.create(model=MODEL, prompt="Hi again", max_tokens=100)
    assert len(generates(d1)) == 1 and len(generates(d2)) == 2  # d1 gets nothing new while stuck
    d1.step_started_at, d1.mode = None, "tokens"  # its step ended: back in rotation
    wait_until(lambda: not gateway.backend._registry.get("d1").is_stuck, "d1 did not come back")
    gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert len(generates(d1)) == 2  # the prefix router's choice for "Hi" again


def test_the_only_worker_wedged_fails_the_request_with_a_clear_error(gateway):
    gateway.add("d1", mode="wedge")
    r = httpx.post(
        gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5}, timeout=30
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    message = r.json()["error"]["message"]
    assert "worker d1 is stuck: one step has run for" in message and "worker_step_timeout_s is 1 s" in message
    assert httpx.get(gateway.base_url + "/ready").status_code == 503  # listed, but no decode worker takes work
    assert worker_ids(gateway.base_url) == ["d1"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_entry_serves_and_stops_on_sigterm(tok_dir, tmp_path):
    import json
    import shutil
    import signal
    import subprocess
    import sys
    from pathlib import Path

    model = shutil.copytree(tok_dir, tmp_path / "model")  # the tokenizer, and the config a checkpoint has
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    http_port, worker_port = _free_port(), _free_port()
    config = tmp_path / "gw.yaml"
    config.write_text(
        f"model:\n  max_model_len: 128\ngateway:\n  worker_port: {worker_port}\n"
        f"  worker_heartbeat_s: 0.1\n  worker_timeout_s: 0.3\n"
        "transfer:\n  insecure: true\n"
    )  # its fake worker speaks plain ZeroMQ
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(config),
            "--model",
            str(model),
            "--port",
            str(http_port),
            "--api-key",
            "k1",
            "--log-level",
            "warning",
        ],
        cwd=Path(__file__).resolve().parents[1],
    )
    base = f"http://127.0.0.1:{http_port}"
    worker = None
    try:

        def up() -> bool:
            try:
                return httpx.get(base + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "gateway process did not start", timeout_s=20)
        tok = Tokenizer(tok_dir)
        worker = FakeWorker(
            f"tcp://127.0.0.1:{worker_port}", "d1", outputs=[tok.encode(OUTPUT_TEXT, add_special_tokens=False)]
        )
        wait_until(lambda: httpx.get(base + "/ready").status_code == 200, "worker did not register")
        client = openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0)
        r = client.completions.create(model=str(model), prompt="Hi", max_tokens=100)
        assert r.choices[0].text == OUTPUT_TEXT
        assert httpx.get(base + "/v1/workers").status_code == 401  # --api-key took effect
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if worker is not None:
            worker.close()
        if proc.poll() is None:
            proc.kill()


def breaker_state(base_url: str, worker_id: str) -> tuple[float, float]:
    """(failures blamed on the worker, 1 if its breaker is open) from the gateway's /metrics."""
    label = f'{{worker_id="{worker_id}"}}'
    return (
        metric(base_url, f"pdserve:worker_failures_total{label}"),
        metric(base_url, f"pdserve:worker_breaker_open{label}"),
    )


PROMPT = "The quick brown fox jumps over the lazy dog."  # > 4 uncached tokens: prefill on P
# (each request below starts differently: no prefix the router remembers makes it local)


def test_a_decode_worker_blaming_its_prefill_worker_opens_that_breaker_only(gateway):
    # d1 fails every request whose KV a prefill worker should bring (its error event names the prefill
    # worker); the retry leaves p1 out and prefills on d1, which serves it. Three in a row open p1's breaker.
    p1 = gateway.add("p1", role="prefill")
    d1 = gateway.add("d1", peer=p1, mode="fail", culprit="prefill")
    for attempt in range(1, 4):
        r = gateway.client.completions.create(model=MODEL, prompt=f"{attempt} {PROMPT}", max_tokens=100)
        assert r.choices[0].text == OUTPUT_TEXT
        assert breaker_state(gateway.base_url, "p1") == (attempt, 1.0 if attempt == 3 else 0.0)
        assert breaker_state(gateway.base_url, "d1") == (0.0, 0.0)
    assert [g.prefill_address for g in generates(d1)] == [p1.address, ""] * 3
    # Open: p1 gets nothing, d1 prefills the next request itself at once.
    r = gateway.client.completions.create(model=MODEL, prompt=f"4 {PROMPT}", max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT and generates(d1)[-1].prefill_address == ""
    assert metric(gateway.base_url, 'pdserve:route_decisions_total{policy="prefix",result="retry"}') == 3


def test_a_decode_worker_failing_by_itself_is_blamed_and_others_serve(gateway):
    p1 = gateway.add("p1", role="prefill")
    d1 = gateway.add("d1", peer=p1, mode="fail", culprit="decode", kv_blocks_in_use=0)
    d2 = gateway.add("d2", peer=p1, kv_blocks_in_use=10)  # more loaded: d1 is tried first while it may be
    for attempt in range(1, 4):
        r = gateway.client.completions.create(model=MODEL, prompt=f"{attempt} {PROMPT}", max_tokens=100)
        assert r.choices[0].text == OUTPUT_TEXT
        assert breaker_state(gateway.base_url, "d1") == (attempt, 1.0 if attempt == 3 else 0.0)
    assert breaker_state(gateway.base_url, "p1") == (0.0, 0.0) and breaker_state(gateway.base_url, "d2")[0] == 0
    gateway.client.completions.create(model=MODEL, prompt=f"4 {PROMPT}", max_tokens=100)
    assert len(generates(d1)) == 3 and len(generates(d2)) == 4  # open: d1 got nothing more


def test_nobodys_fault_counts_against_no_one_and_the_retry_avoids_both(gateway):
    p1 = gateway.add("p1", role="prefill")
    d1 = gateway.add("d1", peer=p1, mode="fail", culprit="none")
    d2 = gateway.add("d2", peer=p1, kv_blocks_in_use=10)
    r = gateway.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100)
    assert r.choices[0].text == OUTPUT_TEXT
    assert [g.prefill_address for g in generates(d1)] == [p1.address]
    assert [g.prefill_address for g in generates(d2)] == [""]  # neither d1 nor p1 again
    for worker_id in ("p1", "d1", "d2"):
        assert breaker_state(gateway.base_url, worker_id) == (0.0, 0.0)


def test_a_prefill_worker_cannot_blame_the_decode_worker(gateway):
    p1 = gateway.add("p1", role="prefill", mode="fail", culprit="decode")
    d1 = gateway.add("d1", peer=p1, token_delay_s=0.5)  # its tokens come after p1's error
    before = metric(gateway.base_url, 'pdserve:rejected_frames_total{reason="invalid_value"}')
    r = gateway.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert r.choices[0].text == OUTPUT_TEXT[: len(r.choices[0].text)] and r.choices[0].text
    assert [g.prefill_address for g in generates(d1)] == [p1.address, ""]
    assert breaker_state(gateway.base_url, "p1")[0] == 1 and breaker_state(gateway.base_url, "d1")[0] == 0
    assert metric(gateway.base_url, 'pdserve:rejected_frames_total{reason="invalid_value"}') == before + 1


def test_a_refused_request_is_answered_at_once_and_blames_nobody(gateway):
    d1 = gateway.add("d1")
    d1.mode = "refuse"
    with pytest.raises(openai.BadRequestError):
        gateway.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert len(generates(d1)) == 1 and breaker_state(gateway.base_url, "d1") == (0.0, 0.0)
