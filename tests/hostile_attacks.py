"""The attacks of the hostile-peer suite, each one function: tests/test_hostile_peers.py runs them against
an idle cluster and asserts each detail, the chaos tool (tests/chaos/hostile.py) runs them under load and
reports the counts. Each returns how many hostile messages or connection attempts it made (and what the
attacker saw, where that is the proof it failed); none asserts: the victims' counters say what was refused.

``Target`` is where an attacker on the worker network aims: the gateway's worker endpoint, the workers'
job and KV endpoints, the gateway's HTTP URL, and the cluster key file (for attacks by a key holder)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import httpx
import zmq

from protocol.codec import encode
from protocol.curve import ClusterKey, PlaneSecurity
from protocol.kv_messages import Abort, Commit, HandshakeReply
from protocol.serving import MAX_STRUCTURED_OUTPUT_CHARS, Goodbye, TokenEvent, TokenEvents
from tests import hostile

FLUSH_MS = 2000  # a socket closed after an attack waits this long for its frames to leave


@dataclass(slots=True)
class Target:
    ctx: zmq.Context
    key_file: str  # the cluster key, as a compromised member holds it
    gateway: str  # the gateway's worker endpoint (tcp://host:port)
    prefill: str  # a prefill worker's job endpoint
    decode_kv: str  # a decode worker's KV receiver endpoint
    url: str  # the gateway's HTTP base URL
    model: str


def forged_registrations(t: Target) -> int:
    """Registrations without the key: no CURVE, another key, the server's public key leaked but no proof
    key, and a member's registration replayed from another connection. Only the last two reach pdserve
    code (``bad_proof``); ZeroMQ drops the others in the CURVE handshake."""
    plain = hostile.dealer(t.ctx, t.gateway)
    stranger = hostile.dealer(t.ctx, t.gateway, PlaneSecurity(ClusterKey.from_secret(os.urandom(32))))
    real = ClusterKey.from_file(t.key_file)
    forged_signers = {role: os.urandom(32) for role in real.signing_seeds}  # the server key but no signer
    leaked = PlaneSecurity(ClusterKey("", real.server_secrets, forged_signers, real.public))
    outsider = hostile.dealer(t.ctx, t.gateway, leaked)
    incarnation = uuid.uuid4().hex
    proof = hostile.key_holder(t.key_file).registration_proof("replayed", incarnation, "decode")
    thief = hostile.dealer(t.ctx, t.gateway, hostile.key_holder(t.key_file))
    for _ in range(5):  # a DEALER whose handshake never completes has no peer to queue for: it refuses
        for sock, worker_id in ((plain, "rogue-plain"), (stranger, "rogue-stranger")):
            with contextlib.suppress(zmq.Again):
                sock.send(encode(hostile.heartbeat(worker_id, "decode", "tcp://127.0.0.1:9", "i")), zmq.NOBLOCK)
        time.sleep(0.1)
    hostile.register(outsider, leaked, "rogue-leaked", "decode", "tcp://127.0.0.1:9")
    thief.send(encode(hostile.heartbeat("replayed", "decode", "tcp://127.0.0.1:9", incarnation, proof)))
    for sock in (plain, stranger):
        sock.close(linger=0)
    for sock in (outsider, thief):
        sock.close(linger=FLUSH_MS)
    return 5 * 2 + 2


def identity_takeover(t: Target, victim: str) -> int:
    """A key holder registers under a registered worker's id, from its own connection id (refused:
    ``identity_taken``) and from the victim's (refused by ZeroMQ: the id is taken)."""
    evil = hostile.key_holder(t.key_file)
    for identity in (None, victim.encode()):
        sock = hostile.dealer(t.ctx, t.gateway, evil, identity)
        hostile.register(sock, evil, victim, "decode", "tcp://127.0.0.1:9")
        sock.close(linger=FLUSH_MS)
    return 2


def register_bystander(t: Target, worker_id: str = "evil") -> zmq.Socket:
    """A key holder registered as a draining prefill worker (nothing is routed to it), so the frames it
    sends are its own; ``leave`` takes it out of the pool."""
    evil = hostile.key_holder(t.key_file)
    sock = hostile.dealer(t.ctx, t.gateway, evil)
    hostile.register(sock, evil, worker_id, "prefill", "tcp://127.0.0.1:9", draining=True)  # its key's proof
    return sock


def leave(sock: zmq.Socket, worker_id: str = "evil") -> None:
    sock.send(encode(Goodbye(worker_id)))
    sock.close(linger=FLUSH_MS)


def forged_tokens(sock: zmq.Socket, rid: str) -> int:
    """A whole fake answer for a request the sender does not serve (refused: ``not_assigned``)."""
    sock.send(encode(TokenEvent(rid, 0, 0, [5, 6, 7], finish_reason="stop")))
    return 1


def forged_token_batch(sock: zmq.Socket, rid: str) -> int:
    """The same, as one engine step's batch of two events (each refused on its own: ``not_assigned``)."""
    events = [TokenEvent(rid, 0, 0, [5, 6]), TokenEvent(rid, 0, 2, [7], finish_reason="stop")]
    sock.send(encode(TokenEvents(events)))
    return 1


def forged_kv(t: Target, rid: str, generation: int, kv_address: str, block_size: int) -> tuple[int, list]:
    """KV written, committed and aborted by a key holder the request was not given: through the project's
    own sender (whose events are what the receiver answered), then a commit and an abort by hand. Returns
    (frames sent, the sender's events); the sender stays open for the answers (``sender.channel.close``)."""
    sender = hostile.kv_sender(t.ctx, kv_address, hostile.key_holder(t.key_file), block_size)
    sender.send(rid, generation, [0], [0])
    sender.commit(rid, generation, first_token=5)
    events = hostile.drive(sender, lambda events: bool(events))
    sender.channel.send([encode(Commit(rid, generation, sender.incarnation, first_token=5))])
    sender.channel.send([encode(Abort(rid, generation, sender.incarnation, "forged"))])
    time.sleep(0.5)  # the hand-made frames reach the receiver before the connection goes
    sender.channel.close()
    return 4, events


def replayed_kv(t: Target, rid: str, generation: int, kv_address: str, block_size: int) -> tuple[int, list]:
    """A write for a request that is over, replayed on a new connection: the range is gone (``stale``)."""
    sender = hostile.kv_sender(t.ctx, kv_address, hostile.key_holder(t.key_file), block_size)
    sender.send(rid, generation, [0], [0])
    events = hostile.drive(sender, lambda events: bool(events))
    sender.channel.close()
    return 1, events


HANDSHAKES = {  # a key holder's KV receiver answering every handshake with one of these
    "transport": dict(transport="carrier-pigeon", credits=8),
    "credits": dict(transport="zmq", credits=0),
    "cuda": dict(transport="cuda_ipc", credits=8, shm_fence_name="pdserve-fence-0-nope"),
}
WINDOWS = {  # ... or accepting shm and granting each transfer one of these windows (kvtransfer/shm_window.py)
    "window-path": ("../../etc/passwd", [0, 1]),
    "window-missing": ("pdserve-win-0-nope", [0, 1]),
    "window-outside-pool": ("pdserve-win-0-nope", [10**6]),
}


def malformed_jobs_and_handshakes(t: Target, block_size: int) -> tuple[int, dict[str, str]]:
    """PrefillJobs to a prefill worker with a bad KV address, a bad scheme, destination blocks outside the
    receiver's pool, and KV receivers (the key holder's) whose handshake replies are hostile. Returns
    (jobs sent, rid -> the PrefillFailed reason each got)."""
    evil = hostile.key_holder(t.key_file)
    to_prefill = hostile.dealer(t.ctx, t.prefill, evil)
    fakes = {
        name: hostile.FakeReceiver(
            t.ctx, evil, HandshakeReply(accepted=True, receiver_incarnation="x", num_blocks=64, **reply)
        )
        for name, reply in HANDSHAKES.items()
    }
    shm = HandshakeReply(accepted=True, receiver_incarnation="x", num_blocks=64, transport="shm", credits=8)
    fakes |= {name: hostile.FakeReceiver(t.ctx, evil, shm, window) for name, window in WINDOWS.items()}
    jobs = [hostile.job("bad-address", "x", block_size), hostile.job("bad-scheme", "ipc:///tmp/nope", block_size)]
    out_of_pool = hostile.job("out-of-pool", t.decode_kv, block_size)
    out_of_pool.dst_block_ids = [10**6 + i for i in range(len(out_of_pool.dst_block_ids))]
    jobs.append(out_of_pool)
    jobs += [hostile.job(f"handshake-{name}", fake.address, block_size) for name, fake in fakes.items()]
    try:
        for j in jobs:
            to_prefill.send(encode(j))
        failed = {r.rid: r.reason for r in hostile.replies(to_prefill, len(jobs), timeout_s=60)}
    finally:
        for fake in fakes.values():
            fake.close()
        to_prefill.close(linger=0)
        evil.close()  # its ZAP handler, before the context ends
    return len(jobs), failed


def _http_socket(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def slowloris(url: str, give_up_s: float = 60.0) -> bool:
    """Request headers that never end, a byte every 0.1 s; True once the gateway dropped the connection."""
    sock = _http_socket(url)
    try:
        headers = itertools.chain([b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"], itertools.repeat(b"x"))
        return dribble_until_dropped(sock, headers, give_up_s=give_up_s)
    finally:
        sock.close()


def dribble_until_dropped(sock: socket.socket, pieces, every_s: float = 0.1, give_up_s: float = 60.0) -> bool:
    """Sends ``pieces`` one by one, ``every_s`` apart, for up to ``give_up_s``; True once the server has
    closed the connection (a send fails or a read sees the end)."""
    sock.settimeout(every_s)
    give_up = time.monotonic() + give_up_s
    for piece in pieces:
        if time.monotonic() > give_up:
            return False
        try:
            sock.sendall(piece)
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def never_reading_client(url: str, model: str, aborted, give_up_s: float = 300.0) -> bool:
    """A stream of 8 long completions with 20 logprobs a token (megabytes of SSE) whose client never reads
    (a 4 KB receive window); True once ``aborted()`` says the gateway gave up on it (its write timeout)
    and aborted the request."""
    body = json.dumps(
        {
            "model": model,
            "prompt": [5] * 20,
            "max_tokens": 1500,
            "n": 8,  # at most max_num_seqs (the hostile chaos cluster runs 8)
            "logprobs": 20,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = _http_socket(url, rcvbuf=4096)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        give_up = time.monotonic() + give_up_s
        while time.monotonic() < give_up:
            if aborted():
                return True
            time.sleep(0.5)
        return False
    finally:
        sock.close()


def huge_grammar(url: str, model: str) -> httpx.Response:
    """A regex one character past the limit: a 400 naming it, and nothing reaches a worker."""
    return httpx.post(
        f"{url}/v1/completions",
        timeout=30,
        json={
            "model": model,
            "prompt": "Hi",
            "max_tokens": 2,
            "structured_outputs": {"regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)},
        },
    )
