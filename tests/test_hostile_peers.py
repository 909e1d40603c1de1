"""Attacks on the worker plane of a real ``pdserve serve`` cluster (gateway, prefill and decode processes,
CURVE on, the default), by processes on the same network using only the project's own protocol module.

Without the cluster key an attacker cannot connect, register or replay a registration. With it (a
compromised member) it still cannot take over a registered worker's id, speak for a request it was not
given (token events, KV writes, commits, aborts), or kill a worker with a malformed job or handshake.
After each attack the victims are the same processes, serve a fresh prompt exactly as the single engine
does, and hold no KV block nor more file descriptors than before (docs/security.md).

``HOSTILE_PEERS_JSON=docs/hostile.json`` writes each attack's counts for the chaos report
(docs/reliability.md, tests/chaos/report.py)."""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import yaml
import zmq

from cluster.keygen import write_private_key
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests import hostile
from tests import hostile_attacks as attacks
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

BLOCK = 16
KEY_FILE = write_private_key()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FD_SLACK = 3  # sockets a worker may have open or not at a given moment (a reconnect in progress)
REJECTED = re.compile(r'^pdserve:rejected_frames_total\{reason="(\w+)"\} (\S+)$', re.M)
JOB_LINE = re.compile(r"rid=(\S+) prefill job -> \S+: tokens \[\d+, \d+\), (\d+) blocks, generation (\d+)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("hostile"),
        engine={"block_size": BLOCK, "kv_cache_memory_mb": 8},
        gateway={"local_prefill_max_tokens": 0},  # every prompt goes through a prefill worker
        transfer={"cluster_key_file": KEY_FILE},
    )
    yield serve
    for worker in ("prefill-0", "decode-0"):  # never leave a frozen worker behind a failed test
        serve.signal(worker, signal.SIGCONT)
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture(scope="module")
def reference():
    return LLM(str(tiny_model_dir("llama")), block_size=BLOCK)


@pytest.fixture(scope="module")
def ledger():
    """Each attack's counts; written for the chaos report when HOSTILE_PEERS_JSON names a file."""
    rows: list[dict] = []
    yield rows
    if path := os.environ.get("HOSTILE_PEERS_JSON"):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        with open(path, "w") as f:
            json.dump(
                {
                    "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
                    "commit": head.stdout.strip(),
                    "scenarios": rows,
                },
                f,
                indent=1,
            )


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


prompt_of = hostile.prompt_of


def complete(cluster, prompt: list[int], max_tokens: int = 8) -> str:
    reply = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=120,
        json={
            "model": hostile.MODEL,
            "prompt": [prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def expected(reference: LLM, prompt: list[int], max_tokens: int = 8) -> str:
    [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return reference.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)  # as the gateway shows it


def gateway_metric(cluster, name: str) -> float:
    body = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + " "))


def rejected(cluster, reason: str, worker: str | None = None) -> float:
    name = f'pdserve:rejected_frames_total{{reason="{reason}"}}'
    return gateway_metric(cluster, name) if worker is None else cluster.metric(worker, name)


def endpoints(cluster) -> dict[str, str]:
    worker_port = yaml.safe_load(cluster.config_path.read_text())["gateway"]["worker_port"]
    address = {w["id"]: w["address"] for w in cluster.workers()}
    return {
        "gateway": f"tcp://127.0.0.1:{worker_port}",
        "prefill": address["prefill-0"],
        "decode_kv": address["decode-0"],
    }


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rejections(cluster) -> collections.Counter:
    """``pdserve:rejected_frames_total`` by reason, summed over the gateway and every worker."""
    bodies = [httpx.get(f"{cluster.url}/metrics", timeout=5).text]
    bodies += [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text for port in cluster.worker_http.values()]
    total: collections.Counter = collections.Counter()
    for body in bodies:
        for reason, value in REJECTED.findall(body):
            total[reason] += int(float(value))
    return total


class Victims:
    """The worker processes before an attack: afterwards the same pids, an exact answer, nothing held."""

    def __init__(self, cluster, reference, ledger: list[dict], scenario: str):
        self.cluster, self.reference, self.ledger, self.scenario = cluster, reference, ledger, scenario
        complete(cluster, prompt_of(2 * BLOCK + 3, seed=99))  # connections between the workers are up
        cluster.wait_idle()
        self.pids = dict(cluster.worker_pid)
        self.fds = {w: fd_count(pid) for w, pid in self.pids.items()}
        self.rejected_before = rejections(cluster)
        self.attacks = 0  # hostile messages and connection attempts, for the report

    def assert_unharmed(self, seed: int) -> None:
        cluster = self.cluster
        assert cluster.worker_pid == self.pids, "a worker died and was restarted"
        prompt = prompt_of(3 * BLOCK + 5, seed)
        assert complete(cluster, prompt) == expected(self.reference, prompt)
        assert {w["id"] for w in cluster.wait_idle()} == {"prefill-0", "decode-0"}  # no impostor registered
        for worker, pid in self.pids.items():
            cluster.wait_until(
                lambda: fd_count(pid) <= self.fds[worker] + FD_SLACK,
                f"{worker}'s file descriptors back to {self.fds[worker]}",
            )
        refused = rejections(cluster) - self.rejected_before
        self.ledger.append(
            {
                "scenario": self.scenario,
                "attacks": self.attacks,
                "refused": dict(refused),
                "after": "pids unchanged, exact answer, 0 blocks in use, fds back",
            }
        )


@pytest.fixture
def victims(cluster, reference, ledger, request) -> Victims:
    return Victims(cluster, reference, ledger, request.node.name.removeprefix("test_").replace("_", " "))


def target(cluster, ctx) -> attacks.Target:
    e = endpoints(cluster)
    return attacks.Target(ctx, KEY_FILE, e["gateway"], e["prefill"], e["decode_kv"], cluster.url, hostile.MODEL)


def test_without_the_key_nobody_connects_registers_or_replays_a_registration(cluster, victims, ctx):
    before = rejected(cluster, "bad_proof")
    victims.attacks += attacks.forged_registrations(target(cluster, ctx))
    cluster.wait_until(lambda: rejected(cluster, "bad_proof") >= before + 2, "both forged proofs refused")
    assert {w["id"] for w in cluster.workers()} == {"prefill-0", "decode-0"}
    victims.assert_unharmed(seed=1)


def test_a_key_holder_cannot_take_over_a_registered_worker_id(cluster, victims, ctx):
    before = rejected(cluster, "identity_taken")
    incarnation = cluster.registered("decode-0")["incarnation"]
    victims.attacks += attacks.identity_takeover(target(cluster, ctx), "decode-0")
    cluster.wait_until(lambda: rejected(cluster, "identity_taken") >= before + 1, "takeover refused")
    assert cluster.registered("decode-0")["incarnation"] == incarnation
    assert cluster.registered("decode-0")["address"] == endpoints(cluster)["decode_kv"]
    victims.assert_unharmed(seed=2)


def frozen_prefill_job(cluster, prompt: list[int]) -> tuple[threading.Thread, list, str, int]:
    """A request sent while prefill-0 is frozen: its decode worker has reserved blocks and sent the job.
    Returns (the client thread, its result box, the request's rid and transfer generation)."""
    seen = len(cluster.log)
    result: list[str] = []
    client = threading.Thread(target=lambda: result.append(complete(cluster, prompt)), daemon=True)
    cluster.signal("prefill-0", signal.SIGSTOP)
    client.start()
    match = cluster.wait_until(
        lambda: next((m for line in cluster.log[seen:] if (m := JOB_LINE.search(line))), None),
        "the decode worker's prefill job",
    )
    return client, result, match.group(1), int(match.group(3))


def test_a_key_holder_cannot_speak_for_a_request_it_was_not_given(cluster, victims, reference, ctx):
    """Forged token events to the gateway; forged KV writes, commit and abort to the decode worker; and,
    once the request is done, the same frames replayed."""
    t = target(cluster, ctx)
    # A member, registered (so its frames are its own) but draining: nothing is routed to it.
    to_gateway = attacks.register_bystander(t)
    cluster.wait_until(lambda: cluster.registered("evil"), "the key holder registered")

    prompt = prompt_of(3 * BLOCK + 7, seed=3)
    gw_before, d_before = rejected(cluster, "not_assigned"), rejected(cluster, "not_assigned", "decode-0")
    try:
        client, result, rid, generation = frozen_prefill_job(cluster, prompt)
        victims.attacks += attacks.forged_tokens(to_gateway, rid) + attacks.forged_token_batch(to_gateway, rid)
        # one forged event alone, then each of a forged batch's two
        cluster.wait_until(lambda: rejected(cluster, "not_assigned") >= gw_before + 3, "forged tokens refused")
        sent, events = attacks.forged_kv(t, rid, generation, t.decode_kv, BLOCK)
        victims.attacks += sent
        [event] = events
        assert not event.ok and event.reason == "rejected by receiver: not_assigned", event
        cluster.wait_until(
            lambda: rejected(cluster, "not_assigned", "decode-0") >= d_before + 3,
            "forged write, commit and abort refused",
        )
    finally:
        cluster.signal("prefill-0", signal.SIGCONT)
    client.join(timeout=120)
    assert result == [expected(reference, prompt)]
    # Replayed after the request finished (on a new connection): the range is gone, the frames are stale.
    sent, [event] = attacks.replayed_kv(t, rid, generation, t.decode_kv, BLOCK)
    assert not event.ok and event.reason == "rejected by receiver: stale", event
    victims.attacks += sent + attacks.forged_tokens(to_gateway, rid)
    attacks.leave(to_gateway)
    cluster.wait_until(lambda: not cluster.registered("evil"), "the key holder left the pool")
    victims.assert_unharmed(seed=4)


def test_malformed_jobs_and_hostile_handshakes_do_not_kill_the_prefill_worker(cluster, victims, ctx):
    sent, failed = attacks.malformed_jobs_and_handshakes(target(cluster, ctx), BLOCK)
    victims.attacks += sent
    assert len(failed) == sent == 3 + len(attacks.HANDSHAKES) + len(attacks.WINDOWS), failed
    assert "kv_address" in failed["bad-address"] and "kv_address" in failed["bad-scheme"]
    assert "outside the receiver's pool" in failed["out-of-pool"]
    for name in attacks.HANDSHAKES:
        assert "invalid handshake reply" in failed[f"handshake-{name}"], failed[f"handshake-{name}"]
    assert "cannot map the window: invalid shared tensor name" in failed["handshake-window-path"]
    assert "cannot map the window" in failed["handshake-window-missing"]
    assert "window block ids outside the receiver's pool" in failed["handshake-window-outside-pool"]
    victims.assert_unharmed(seed=5)


def test_a_fake_prefill_worker_cannot_kill_the_decode_worker_or_poison_its_cache(cluster, victims, reference, ctx):
    before = rejected(cluster, "invalid_value", "decode-0")
    fake = hostile.FakePrefill(ctx, endpoints(cluster)["gateway"], hostile.key_holder(KEY_FILE), BLOCK)
    try:
        cluster.wait_until(lambda: cluster.registered("a-fake-prefill"), "the fake prefill worker registered")
        prompt = prompt_of(3 * BLOCK + 9, seed=6)
        # The decode worker refuses the fake's first token and fails the attempt; the gateway blames the
        # prefill worker, retries on the real one, and the client gets the engine's answer.
        assert complete(cluster, prompt) == expected(reference, prompt)
        assert [e.ok for e in fake.events] == [True]  # it was assigned: its writes and commit were taken
        assert rejected(cluster, "invalid_value", "decode-0") == before + 1
        # Its blocks never entered the prefix cache: the same prompt again is still exact.
        assert complete(cluster, prompt) == expected(reference, prompt)
    finally:
        fake.close()
    cluster.wait_until(lambda: not cluster.registered("a-fake-prefill"), "the fake prefill worker left")
    # A prefill worker advertising an address no socket can take is refused at registration.
    evil = hostile.key_holder(KEY_FILE)
    sock = hostile.dealer(ctx, endpoints(cluster)["gateway"], evil)
    before = rejected(cluster, "invalid_value")
    hostile.register(sock, evil, "a-bad-address", "prefill", "x")
    victims.attacks += 1 + len(fake.events) + 1  # the fake's registration, its poisoned transfers, this one
    cluster.wait_until(lambda: rejected(cluster, "invalid_value") == before + 1, "the bad address refused")
    assert not cluster.registered("a-bad-address")
    sock.close(linger=0)
    victims.assert_unharmed(seed=7)


@pytest.mark.parametrize("role", ["prefill_node", "decode_node"])
def test_a_worker_without_a_key_refuses_to_start(role, tmp_path):
    section = role.removesuffix("_node")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            role,
            "--set",
            f"model.path={tiny_model_dir('llama')}",
            "--set",
            f"{section}.gateway_address=tcp://127.0.0.1:9",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "PDSERVE_TRANSFER_CLUSTER_KEY_FILE": ""},
    )
    assert out.returncode == 78  # EX_CONFIG: a configuration error, never restarted
    assert "no cluster key: set transfer.cluster_key_file" in out.stderr, out.stderr
