"""Hostile frames at every port a ``pdserve serve`` cluster listens on with ZeroMQ: the gateway's worker
ROUTER, the prefill worker's job ROUTER and the decode worker's KV receiver. Random, truncated,
oversized and wrong-typed msgpack, wrong frame counts, records meant for another socket, and KV
writes/commits under a stale generation or an unknown incarnation. Each node must drop them, count
them in its /metrics (exactly one count per hostile message), and keep serving: a real disaggregated
request afterwards gives the same greedy text as before the barrage.

The fuzzer holds the cluster key (a compromised member, the strongest attacker short of code execution):
without it no frame gets past the CURVE handshake at all (tests/test_hostile_peers.py shows that)."""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.request

import msgpack
import pytest
import yaml
import zmq

from cluster.keygen import write_private_key
from protocol.codec import decode, encode
from protocol.curve import ClusterKey, PlaneSecurity
from protocol.kv_messages import (
    KV_PROTOCOL_VERSION,
    Abort,
    BlockWrite,
    Commit,
    CommitAck,
    Credit,
    Handshake,
    HandshakeReply,
    KVCompat,
    WriteRejected,
)
from protocol.serving import (
    AbortRequest,
    Heartbeat,
    PrefillJob,
    PromptLogprobs,
    SamplingSpec,
    TokenEvent,
    TokenLogprobRecord,
)
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

MODEL = str(tiny_model_dir("llama"))
BLOCK = 16
MAX_FRAME = 4 << 20
KEY_FILE = write_private_key()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("cluster"),
        engine={"block_size": BLOCK, "kv_cache_memory_mb": 8},
        transfer={"max_frame_bytes": MAX_FRAME, "transport": "zmq", "cluster_key_file": KEY_FILE},
        gateway={"local_prefill_max_tokens": 0},
    )  # every prompt goes through prefill + KV
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def endpoints(cluster) -> dict[str, str]:
    worker_port = yaml.safe_load(cluster.config_path.read_text())["gateway"]["worker_port"]
    # heartbeat addresses: a prefill worker's job ROUTER, a decode worker's KV receiver
    address = {w["id"]: w["address"] for w in cluster.workers()}
    return {
        "gateway": f"tcp://127.0.0.1:{worker_port}",
        "prefill": address["prefill-0"],
        "decode_kv": address["decode-0"],
    }


@pytest.fixture(scope="module")
def baseline(cluster) -> str:
    return greedy_text(cluster)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def greedy_text(cluster) -> str:
    body = json.dumps(
        {"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(f"{cluster.url}/v1/completions", body, {"content-type": "application/json"})
    response = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert response["usage"]["completion_tokens"] == 8
    return response["choices"][0]["text"]


def gateway_metric(cluster, name: str) -> float:
    body = urllib.request.urlopen(f"{cluster.url}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def wait_for_count(read, expected: float, timeout_s: float = 30.0) -> float:
    give_up = time.monotonic() + timeout_s
    while read() < expected and time.monotonic() < give_up:
        time.sleep(0.1)
    time.sleep(0.3)  # and not more than expected: a frame counted twice would show up by now
    return read()


def dealer(ctx, endpoint: str) -> zmq.Socket:
    sock = PlaneSecurity(ClusterKey.from_file(KEY_FILE)).client(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def garbage_messages(seed: int) -> list[list[bytes]]:
    """Messages every receiving socket must reject: one count each."""
    rng = random.Random(seed)
    heartbeat = encode(Heartbeat("fuzz", "decode", "tcp://127.0.0.1:1", "inc", 16, 10, 10, 0, 0, 0, 0))
    return [
        *[[rng.randbytes(rng.randint(1, 300))] for _ in range(10)],  # random bytes
        [heartbeat[: len(heartbeat) // 2]],  # truncated
        [b""],  # empty frame
        [msgpack.packb(12345)],
        [msgpack.packb({"a": 1})],
        [msgpack.packb(["no.such.tag", {}])],
        [msgpack.packb(["serve.heartbeat", {"worker_id": 5}])],  # right tag, wrong fields
        [
            msgpack.packb(
                [
                    "serve.heartbeat",
                    {
                        "worker_id": "x",
                        "role": "decode",
                        "address": "a",
                        "incarnation": "i",
                        "block_size": "sixteen",
                        "kv_blocks_total": 1,
                        "kv_blocks_free": 1,
                        "kv_blocks_in_use": 0,
                        "num_running": 0,
                        "num_waiting": 0,
                        "queued_prefill_tokens": 0,
                    },
                ]
            )
        ],  # wrong-typed field
        [msgpack.packb(nested(200))],  # deeply nested garbage
        [msgpack.packb(["serve.abort", {"rid": "r", "reason": "x"}]), b"extra frame", b"and another"],
    ]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def send_all(sock: zmq.Socket, messages: list[list[bytes]]) -> None:
    for frames in messages:
        sock.send_multipart(frames)


def test_gateway_worker_router_rejects_and_counts(cluster, endpoints, baseline, ctx):
    name = "pdserve:rejected_frames_total"  # every reason: the spoofed heartbeat is bad_proof, the rest malformed
    before = gateway_metric(cluster, name)
    sock = dealer(ctx, endpoints["gateway"])
    messages = garbage_messages(seed=1)
    sampling = SamplingSpec(max_tokens=1)
    messages += [
        [encode(PrefillJob("r", [1], 0, [0], 1, "tcp://x:1", True, sampling, time.time() + 9))],  # wrong way
        [encode(Heartbeat("decode-0", "decode", "tcp://127.0.0.1:1", "fake", 16, 9, 9, 0, 0, 0, 0))],  # spoofed id
        [msgpack.packb(["serve.prompt_logprobs", {"rid": "r", "start": 0, "logprobs": [], "ranks": [1]}])],
    ]
    send_all(sock, messages)
    assert wait_for_count(lambda: gateway_metric(cluster, name), before + len(messages)) == before + len(messages)
    # Late or forged token events for requests that do not exist are dropped without effect.
    sock.send(encode(TokenEvent("cmpl-does-not-exist", 0, 0, [1, 2, 3])))
    sock.send(encode(PromptLogprobs("cmpl-does-not-exist", 0, [TokenLogprobRecord(3, -1.0)], [1])))
    sock.send(b"\x00" * (2 * (1 << 20)))  # over MAXMSGSIZE: zmq drops the connection before our code sees it
    assert greedy_text(cluster) == baseline
    assert {w["id"] for w in cluster.wait_idle()} == {"prefill-0", "decode-0"}  # no impostor registered


def test_prefill_job_router_rejects_and_counts(cluster, endpoints, baseline, ctx):
    malformed, rejected = "pdserve:prefill_malformed_frames_total", "pdserve:prefill_jobs_rejected_total"
    before, before_rejected = cluster.metric("prefill-0", malformed), cluster.metric("prefill-0", rejected)
    sock = dealer(ctx, endpoints["prefill"])
    messages = garbage_messages(seed=2) + [[encode(TokenEvent("r", 0, 0, [1]))]]  # a gateway-bound record
    send_all(sock, messages)
    count = wait_for_count(lambda: cluster.metric("prefill-0", malformed), before + len(messages))
    assert count == before + len(messages)
    # Well-formed jobs that are wrong: out-of-vocabulary tokens, dst blocks not matching the prompt,
    # an expired deadline. Each is answered PrefillFailed and counted as rejected.
    sampling = SamplingSpec(max_tokens=1)
    jobs = [
        PrefillJob("bad-vocab", [10**9], 0, [0], 1, endpoints["decode_kv"], True, sampling, time.time() + 30),
        PrefillJob(
            "bad-blocks", list(range(5, 40)), 0, [0], 1, endpoints["decode_kv"], True, sampling, time.time() + 30
        ),
        PrefillJob("expired", [5, 6, 7], 0, [0], 1, endpoints["decode_kv"], True, sampling, time.time() - 5),
    ]
    send_all(sock, [[encode(j)] for j in jobs])
    sock.send(encode(AbortRequest("never-seen")))  # idempotent: unknown rids are ignored
    answered = set()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    give_up = time.monotonic() + 30
    while len(answered) < len(jobs) and time.monotonic() < give_up:
        if poller.poll(500):
            reply = sock.recv()
            answered.add(decode(reply).rid)
    assert answered == {j.rid for j in jobs}
    assert wait_for_count(lambda: cluster.metric("prefill-0", rejected), before_rejected + 3) == before_rejected + 3
    sock.send(b"\x00" * (MAX_FRAME + 1))  # over MAXMSGSIZE: dropped by zmq
    assert greedy_text(cluster) == baseline
    cluster.wait_idle()


def kv_compat() -> KVCompat:
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return KVCompat(
        KV_PROTOCOL_VERSION,
        MODEL,
        "float32",
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        head_dim,
        BLOCK,
    )


def replies(sock: zmq.Socket, count: int, timeout_s: float = 30.0) -> list:
    out, give_up = [], time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < give_up:
        if sock.poll(500):
            out.append(decode(sock.recv_multipart()[0]))
    return out


def test_decode_kv_receiver_rejects_stale_and_malformed(cluster, endpoints, baseline, ctx):
    malformed, rejected = "pdserve:kv_malformed_frames_total", "pdserve:kv_rejected_writes_total"
    before, before_rejected = cluster.metric("decode-0", malformed), cluster.metric("decode-0", rejected)
    sock = dealer(ctx, endpoints["decode_kv"])
    messages = garbage_messages(seed=3) + [
        [encode(TokenEvent("r", 0, 0, [1]))],  # not a sender's record
        [b"\x00" * (100 << 10)],  # over the 64 KiB header limit (but under MAXMSGSIZE)
    ]
    send_all(sock, messages)
    assert wait_for_count(lambda: cluster.metric("decode-0", malformed), before + len(messages)) == before + len(
        messages
    )

    # A handshake from an incompatible pool is refused, naming the field.
    compat = kv_compat()
    wrong = KVCompat(**{**{f: getattr(compat, f) for f in compat.__slots__}, "block_size": BLOCK * 2})
    sock.send(encode(Handshake(wrong, "fuzz-incarnation", socket.gethostname(), ["zmq"])))
    [reply] = replies(sock, 1)
    assert isinstance(reply, HandshakeReply) and not reply.accepted and reply.mismatched_field == "block_size"
    # Writes before any accepted handshake: unknown incarnation.
    sock.send(encode(Commit("ghost", 1, "fuzz-incarnation")))
    [reply] = replies(sock, 1)
    assert isinstance(reply, WriteRejected) and reply.reason == "unknown_incarnation"
    # After a valid handshake: a write and a commit for a range that was never reserved (a stale generation).
    sock.send(encode(Handshake(compat, "fuzz-incarnation", socket.gethostname(), ["zmq"])))
    [reply] = replies(sock, 1)
    assert isinstance(reply, HandshakeReply) and reply.accepted, reply
    bytes_per_block = 2 * compat.num_layers * BLOCK * compat.kv_heads * compat.head_dim * 4
    sock.send_multipart(
        [encode(BlockWrite("ghost", 7, "fuzz-incarnation", [0], True, bytes_per_block)), b"\x7f" * bytes_per_block]
    )
    got = replies(sock, 2)
    assert [type(r) for r in got] == [Credit, WriteRejected] and got[1].reason == "stale"
    sock.send(encode(Commit("ghost", 7, "fuzz-incarnation", first_token=3)))
    [ack] = replies(sock, 1)
    assert isinstance(ack, CommitAck) and not ack.ok and ack.reason == "stale"
    sock.send(encode(Abort("ghost", 7, "fuzz-incarnation")))  # unknown range: nothing happens
    assert wait_for_count(lambda: cluster.metric("decode-0", rejected), before_rejected + 3) == before_rejected + 3
    # The stale write landed nowhere: the same greedy text as before.
    assert greedy_text(cluster) == baseline
    cluster.wait_idle()
