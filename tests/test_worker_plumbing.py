"""worker/: the gateway socket rejects bad frames and keeps going; HTTP endpoints; heartbeat timing."""

from __future__ import annotations

import http.client
import sys
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client import CollectorRegistry

from protocol.codec import decode, encode
from protocol.serving import AbortRequest, Busy, Goodbye
from protocol.zmq_util import bind, make_socket
from worker import Drain, EngineMetrics, EngineSnapshot, HeartbeatTimer, WorkerSocket, serve_http


def test_worker_socket_round_trip_and_rejects_bad_frames():
    ctx = zmq.Context()
    try:
        router = make_socket(ctx, zmq.ROUTER)
        ws = WorkerSocket(ctx, bind(router, "127.0.0.1", 0), "w1")
        assert ws.send(Goodbye("w1"))
        assert router.poll(5000)
        identity, frame = router.recv_multipart()
        assert identity == b"w1" and decode(frame) == Goodbye("w1")
        for bad in [b"\xc1garbage", encode(Busy("r", "x")), encode(AbortRequest("r"))[:-1]]:
            router.send_multipart([b"w1", bad])  # not msgpack / not a gateway message / truncated
        router.send_multipart([b"w1", encode(AbortRequest("r9", "gone"))])
        records = []
        while not records:
            records = ws.poll(1000)
        assert records == [AbortRequest("r9", "gone")] and ws.num_rejected == 3
        ws.close()
    finally:
        ctx.destroy(linger=0)


def test_http_metrics_health_ready():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.update(EngineSnapshot(2, 1, 100, 25, 75, 64, 16, 0, kv_live_slots=380, block_size=16))
    ready = [False]
    handle = serve_http("127.0.0.1", 0, registry, lambda: ready[0])
    url = f"http://127.0.0.1:{handle.port}"
    try:
        body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        assert "pdserve:kv_blocks_in_use 25.0" in body and 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in body
        assert "pdserve:kv_live_slots 380.0" in body and "pdserve:kv_slot_utilization 0.95" in body  # 380 / (25 * 16)
        assert 'vllm:prefix_cache_hits_total{model_name="m"} 16.0' in body
        assert 'vllm:prefix_cache_queries_total{model_name="m"} 64.0' in body
        assert 'vllm:num_requests_running{model_name="m"} 2.0' in body
        assert 'vllm:num_requests_waiting{model_name="m"} 1.0' in body
        assert "process_resident_memory_bytes" in body and "process_cpu_seconds_total" in body
        assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/ready", timeout=5)
        assert info.value.code == 503
        ready[0] = True
        assert urllib.request.urlopen(url + "/ready", timeout=5).status == 200
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/nope", timeout=5)
        assert info.value.code == 404
    finally:
        handle.close()
    with pytest.raises(ValueError, match="refusing to bind all interfaces"):
        serve_http("0.0.0.0", 0, registry, lambda: True)


def test_heartbeat_timer_fires_at_once_then_per_interval():
    now = [100.0]
    timer = HeartbeatTimer(5.0, clock=lambda: now[0])
    assert timer.due() and not timer.due()
    now[0] = 104.9
    assert not timer.due() and timer.seconds_left() == pytest.approx(0.1)
    now[0] = 105.0
    assert timer.due() and not timer.due()
    timer.fire_now()
    assert timer.due()


def test_drain_requested_then_started_once_then_over_when_idle_or_at_the_deadline():
    now = [100.0]
    drain = Drain(timeout_s=30.0, clock=lambda: now[0])
    assert (drain.requested, drain.started, drain.start_if_requested(), drain.is_over(in_flight=False)) == (
        False,
        False,
        False,
        False,
    )  # nothing asked: never over, even when idle
    drain.request()
    assert (drain.requested, drain.started, drain.is_over(in_flight=False)) == (True, False, False)
    assert drain.start_if_requested() is True
    assert drain.start_if_requested() is False  # exactly once
    assert drain.is_over(in_flight=True) is False
    now[0] = 129.9
    assert drain.is_over(in_flight=True) is False
    assert drain.is_over(in_flight=False) is True  # the last request finished before the deadline
    now[0] = 130.0
    assert drain.is_over(in_flight=True) is True  # the deadline: what is left gets failed


def test_worker_package_is_torch_free():
    import subprocess

    code = "import sys, worker; assert 'torch' not in sys.modules, 'worker imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_http_server_cannot_be_held_by_slow_clients():
    """An idle and a dribbling connection take the two slots; more are closed at once; the socket timeout
    ends the idle one, the watchdog the dribbling one (each byte resets a timeout, not the deadline),
    and scrapes are served again."""
    import socket
    import threading
    import time

    handle = serve_http("127.0.0.1", 0, CollectorRegistry(), lambda: True, max_connections=2, connection_deadline_s=1.0)
    url = f"http://127.0.0.1:{handle.port}"
    try:
        idle = socket.create_connection(("127.0.0.1", handle.port))
        dribbler = socket.create_connection(("127.0.0.1", handle.port))

        def dribble() -> None:  # a request line that never ends, a byte every 0.1 s, until cut off
            give_up = time.monotonic() + 60
            try:
                dribbler.sendall(b"GET /")
                while time.monotonic() < give_up:
                    dribbler.sendall(b"x")
                    time.sleep(0.1)
            except OSError:
                pass

        threading.Thread(target=dribble, daemon=True).start()
        give_up = time.monotonic() + 60
        while handle.server.num_refused == 0:  # one more connection: closed at once
            assert time.monotonic() < give_up, "a connection past the cap was served"
            with socket.create_connection(("127.0.0.1", handle.port)) as extra:
                extra.settimeout(60)
                extra.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                try:
                    extra.recv(100)
                except ConnectionResetError:
                    pass
        idle.settimeout(60)
        assert idle.recv(100) == b""  # the server ended it
        while handle.server.num_expired == 0:
            assert time.monotonic() < give_up, "the dribbling connection was never cut off"
            time.sleep(0.05)
        idle.close()
        dribbler.close()
        # The cut-off connections' handler threads give their slots back as they finish, just after the
        # shutdown is counted: until then a scrape is still refused, as a Prometheus scrape would be
        # and retried.
        while True:
            try:
                assert urllib.request.urlopen(url + "/health", timeout=30).status == 200
                break
            except (http.client.RemoteDisconnected, ConnectionResetError):
                assert time.monotonic() < give_up, "scrapes were never served again"
                time.sleep(0.05)
    finally:
        handle.close()
