"""Test harness for decode workers: a fake gateway (ROUTER bound by the test) speaking protocol/serving.py."""

from __future__ import annotations

import time
import urllib.request

import zmq

from configs.loader import load_config
from protocol.codec import decode, encode
from protocol.curve import PlaneSecurity
from protocol.serving import Generate, Heartbeat, SamplingSpec, TokenEvent, TokenEvents
from protocol.zmq_util import bind, make_socket
from tests.model_factory import tiny_model_dir


def decode_config(gateway_address: str, decode: dict | None = None, key_file: str = "", **engine):
    """``key_file``: a decode credential (``pdserve keygen --out``): the worker speaks CURVE."""
    overrides = {
        "model.path": str(tiny_model_dir("llama")),
        "model.max_model_len": 256,
        "engine.block_size": 4,
        "engine.num_kv_blocks": 32,
        "engine.max_num_batched_tokens": 64,
        "engine.prefill_chunk_size": 16,
        "engine.num_threads": 1,
        "decode.gateway_address": gateway_address,
        "decode.kv_port": 0,
        "decode.http_port": 0,
        "decode.worker_id": "d0",
        "gateway.worker_heartbeat_s": 0.2,
        "transfer.lease_seconds": 10,
        "transfer.insecure": True,  # the fakes here speak plain ZeroMQ; tests/test_hostile_peers.py runs CURVE
    }
    if key_file:
        overrides.update({"transfer.insecure": False, "transfer.cluster_key_file": key_file})
    overrides.update({f"engine.{k}": v for k, v in engine.items()})
    overrides.update({f"decode.{k}": v for k, v in (decode or {}).items()})
    return load_config(None, env={}, overrides=overrides)


def generate(rid: str, prompt: list[int], prefill_address: str = "", timeout_s: float = 60, **sampling) -> Generate:
    sampling.setdefault("max_tokens", 8)
    return Generate(rid, prompt, SamplingSpec(**sampling), prefill_address, time.time() + timeout_s)


class FakeGateway:
    def __init__(self, ctx: zmq.Context, address: str = "", security: PlaneSecurity | None = None):
        """``address``: bind that endpoint again (a gateway restarted on its port); "": any free port.
        ``security``: a gateway credential's (a CURVE server, as the real gateway's worker socket)."""
        self.sock = make_socket(ctx, zmq.ROUTER)
        if security is not None:
            security.server(self.sock)
        if address:
            for _ in range(200):  # zmq releases a closed socket's port asynchronously
                try:
                    self.sock.bind(address)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
        self.address = address or bind(self.sock, "127.0.0.1", 0)
        self.heartbeats: list[Heartbeat] = []
        self.others: list = []  # every non-heartbeat record, in arrival order (a step's batch unpacked)
        self._unread: list = []  # the rest of a TokenEvents batch, read one at a time
        self.batch_sizes: list[int] = []  # events in each TokenEvents frame received

    def send(self, worker_id: str, record) -> None:
        self.sock.send_multipart([worker_id.encode(), encode(record)])

    def recv(self, timeout_s: float = 30.0, until=lambda record: True):
        """Next non-heartbeat record for which ``until`` holds (heartbeats are kept aside)."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self._unread:
                record = self._unread.pop(0)
            elif not self.sock.poll(50):
                continue
            else:
                _, frame = self.sock.recv_multipart()
                record = decode(frame)
                if isinstance(record, TokenEvents):  # one engine step's events, each as if it came alone
                    self.batch_sizes.append(len(record.events))
                    self._unread, record = record.events[1:], record.events[0]
            if isinstance(record, Heartbeat):
                self.heartbeats.append(record)
                continue
            self.others.append(record)
            if until(record):
                return record
        raise TimeoutError("no matching record from the worker")

    def wait_heartbeat(self, check, timeout_s: float = 30.0) -> Heartbeat:
        """The first heartbeat sent after this call began for which ``check`` holds (older ones may
        describe the worker before the messages the test just sent)."""
        give_up = time.monotonic() + timeout_s
        seen = len(self.heartbeats)
        while time.monotonic() < give_up:
            if len(self.heartbeats) > seen and check(self.heartbeats[-1]):
                return self.heartbeats[-1]
            try:
                self.recv(0.1, until=lambda r: False)
            except TimeoutError:
                pass
        raise TimeoutError(f"no heartbeat matching; last {self.heartbeats[-1:]}")

    def collect(self, rid: str, n: int = 1, timeout_s: float = 60.0) -> dict[int, list[TokenEvent]]:
        """Every event of ``rid`` until each of its n completions has finished or failed."""
        events: dict[int, list[TokenEvent]] = {i: [] for i in range(n)}
        open_ = set(range(n))

        def mine(record) -> bool:
            return isinstance(record, TokenEvent) and record.rid == rid

        while open_:
            event = self.recv(timeout_s, until=mine)
            events[event.index].append(event)
            if event.finish_reason or event.error:
                open_.discard(event.index)
        return events


def tokens_of(events: list[TokenEvent], first_offset: int = 0) -> list[int]:
    """Concatenate a completion's events, checking offsets are contiguous from ``first_offset``."""
    tokens: list[int] = []
    for e in sorted(events, key=lambda e: e.offset):
        assert e.offset == first_offset + len(tokens), (e.offset, first_offset, len(tokens))
        tokens += e.token_ids
    return tokens


def scrape(http_port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
