"""A worker's heartbeats do not wait for its steps (worker/liveness.py): while the loop is inside a step
that blocks, a thread of its own repeats the loop's last heartbeat, saying how long that step has run;
it runs during a long C kernel call (ctypes releases the GIL); it stops before a Goodbye. And the wire
change stays within the codec's rules: a heartbeat of an older worker is refused naming what it lacks."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq

from kernels.cpu import native
from protocol.codec import WireError, decode, encode
from protocol.serving import Goodbye, Heartbeat
from tests.decode_harness import FakeGateway
from worker.gateway_links import GatewayLinks
from worker.liveness import Liveness, StepWatch

INTERVAL_S = 0.05


def heartbeat(worker_id: str = "w0", num_running: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, "decode", "tcp://127.0.0.1:9", "inc", 4, 10, 10, 0, num_running, 0, 0)


def test_step_watch_counts_turns_and_times_the_one_under_way():
    now = [100.0]
    watch = StepWatch(clock=lambda: now[0])
    assert (watch.steps_completed, watch.running_s()) == (0, 0.0)
    with watch.step():
        now[0] += 7.5
        assert (watch.steps_completed, watch.running_s()) == (0, 7.5)
    assert (watch.steps_completed, watch.running_s()) == (1, 0.0)
    with pytest.raises(RuntimeError), watch.step():  # a turn that raised has ended too
        raise RuntimeError("engine step failed")
    assert (watch.steps_completed, watch.running_s()) == (2, 0.0)


@pytest.fixture
def plane():
    ctx = zmq.Context()
    gateway = FakeGateway(ctx)
    links = GatewayLinks(ctx, gateway.address, "w0", timeout_s=5.0, resolve_interval_s=5.0)
    yield gateway, links
    links.close()
    ctx.destroy(linger=0)


def test_heartbeats_go_on_while_the_loop_is_blocked_in_a_step_and_stop_before_goodbye(plane):
    gateway, links = plane
    liveness = Liveness(links, INTERVAL_S, StepWatch())
    released = threading.Event()

    def loop() -> None:  # the worker's loop: one heartbeat, then a step that blocks until released
        liveness.send(heartbeat(num_running=3))
        with liveness.watch.step():
            released.wait()
        liveness.send(heartbeat(num_running=0))

    liveness.start(heartbeat(num_running=0))
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        # Ten intervals into the step, heartbeats still come, each the loop's last with the step's age.
        hb = gateway.wait_heartbeat(lambda hb: hb.step_running_s > 10 * INTERVAL_S)
        assert (hb.worker_id, hb.num_running, hb.steps_completed) == ("w0", 3, 0)
        assert liveness.num_sent_by_thread >= 1
        ages = [h.step_running_s for h in gateway.heartbeats if h.steps_completed == 0]
        assert ages == sorted(ages)  # the same step, growing
    finally:
        released.set()
        thread.join(timeout=10)
    hb = gateway.wait_heartbeat(lambda hb: hb.steps_completed == 1)
    assert (hb.num_running, hb.step_running_s) == (0, 0.0)  # the loop's own, between steps
    liveness.goodbye("w0")
    assert gateway.recv(until=lambda r: isinstance(r, Goodbye)) == Goodbye("w0")
    assert liveness._thread is None  # joined first: nothing can register the worker again after its Goodbye


class _RecordingLinks:
    """Links that note when each heartbeat went out."""

    def __init__(self) -> None:
        self.sent_at: list[float] = []

    def broadcast(self, record) -> None:
        self.sent_at.append(time.monotonic())


def c_linear_call(lib, rows: int, in_features: int, out_features: int):
    """One call of the C linear kernel (a prefill step's bulk) on random data, with nothing around it."""
    torch.manual_seed(0)
    packed = lib.pack_linear(torch.randn(out_features, in_features))
    x, out = torch.randn(rows, in_features), torch.empty(rows, out_features)
    kernel, threads = lib.symbol("pdserve_linear_f32"), torch.get_num_threads()
    return lambda: kernel(
        x.data_ptr(), rows, in_features, packed.data_ptr(), out_features, None, out.data_ptr(), threads
    )


def test_the_heartbeat_thread_runs_during_a_long_c_kernel_call():
    """A prefill step's work is the C kernels' (ctypes releases the GIL around each call): the thread
    must get to run inside one call, not only between calls, or one long call would silence the worker.
    A heartbeat in the middle half of a call is one the thread sent while the call ran (a call that held
    the GIL lets none through there: checked with the same kernel bound through ctypes.PyDLL); a few calls
    give a loaded machine's scheduler room to run the thread."""
    lib = native.load()
    assert lib is not None, "the C kernels did not build here"
    rows, in_features, out_features = 512, 1024, 2048  # a 512-token prompt through a 1024 -> 2048 projection
    assert lib.supports_linear(in_features, out_features)
    call = c_linear_call(lib, rows, in_features, out_features)
    links = _RecordingLinks()
    liveness = Liveness(links, interval_s=0.002, watch=StepWatch())
    liveness.start(heartbeat())
    inside = []
    try:
        for _ in range(200):
            began = time.monotonic()
            call()
            ended = time.monotonic()
            quarter = (ended - began) / 4
            inside = [t for t in links.sent_at if began + quarter < t < ended - quarter]
            if inside:
                break
    finally:
        liveness.stop()
    assert inside, "no heartbeat went out while a C kernel call ran"


def test_a_heartbeat_without_the_step_fields_is_refused_naming_them():
    """An older worker's heartbeat (no step progress) is not misread as "never in a step": the codec
    refuses it and names the fields, as it does any record of another version."""
    wire = msgpack.unpackb(encode(heartbeat()), raw=False)
    del wire[1]["steps_completed"], wire[1]["step_running_s"]
    with pytest.raises(WireError, match=r"missing field\(s\) \['step_running_s', 'steps_completed'\]"):
        decode(msgpack.packb(wire))
    for bad in (-1.0, float("nan"), float("inf")):
        wire = msgpack.unpackb(encode(heartbeat()), raw=False)
        wire[1]["step_running_s"] = bad
        with pytest.raises(WireError, match="bad step progress"):
            decode(msgpack.packb(wire))


def test_the_loop_waiting_on_the_links_holds_the_heartbeat_thread_off_their_sockets(plane):
    """ZeroMQ sockets are one thread's at a time: while the loop waits on the links' sockets, a send
    from the heartbeat thread waits for the lock."""
    gateway, links = plane
    sent = threading.Event()
    with links.locked() as sockets:
        assert len(sockets) == 1
        sender = threading.Thread(target=lambda: (links.broadcast(heartbeat()), sent.set()), daemon=True)
        sender.start()
        sender.join(timeout=0.2)
        assert sender.is_alive() and not sent.is_set()  # still waiting for the lock
    sender.join(timeout=10)
    assert sent.is_set()
    assert gateway.wait_heartbeat(lambda hb: hb.worker_id == "w0")


def test_a_step_past_the_stuck_deadline_is_logged_once_with_every_threads_stack(tmp_path, caplog):
    """What the gateway calls stuck, the worker reports itself: once per step, with where each thread is."""
    stacks = (tmp_path / "stacks.txt").open("w+")
    liveness = Liveness(_RecordingLinks(), 0.01, StepWatch(), stuck_after_s=0.1, stacks_to=stacks)
    released, past = threading.Event(), threading.Event()

    def wedged_loop() -> None:
        with liveness.watch.step():
            released.wait()

    liveness.start(heartbeat())
    loop = threading.Thread(target=wedged_loop, daemon=True)
    with caplog.at_level("ERROR", logger="worker.liveness"):
        loop.start()
        try:
            give_up = time.monotonic() + 60
            while liveness.watch.running_s() <= 5 * 0.1:  # well past the deadline: reported by now, once
                assert time.monotonic() < give_up
                past.wait(0.01)
            while not [r for r in caplog.records if "one step of this worker's loop has run for" in r.message]:
                assert time.monotonic() < give_up
                past.wait(0.01)
        finally:
            released.set()
            loop.join(timeout=10)
            liveness.stop()
    stacks.seek(0)
    dump = stacks.read()
    assert dump.count("Current thread") == 1  # the liveness thread's one report for this step
    assert "in wedged_loop" in dump and "in wait" in dump  # where the loop is: blocked in Event.wait
    reports = [r.message for r in caplog.records if "one step of this worker's loop" in r.message]
    assert len(reports) == 1 and "gateway.worker_step_timeout_s is 0.1 s" in reports[0]
