"""Hostile-peer scenarios of the chaos tool: each attack of tests/hostile_attacks.py (the hostile-peer
suite's own code) against a loaded 2 prefill + 2 decode ``pdserve serve`` cluster, CURVE on with a key
file the key-holding attackers read.

A run: wait until every worker is registered and idle; note each worker's pid, file descriptors and
``pdserve:rejected_frames_total`` (gateway and workers); start the steady load (tests/chaos/load.py);
attack; stop the load; then check: every ordinary request came back exact (a clear error is counted, a
wrong text or a hang fails the run), no worker died, the attack left no trace (no impostor registered,
no stolen id, nothing the attacker sent accepted), every KV block back within SETTLE_S, file
descriptors back to their count (FD_SLACK), and every worker's idle integrity check passed.
"""

from __future__ import annotations

import collections
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import zmq

from cluster.keygen import write_private_key
from tests import hostile
from tests import hostile_attacks as attacks
from tests.chaos.clusters import BLOCK, WORKERS, ServeCluster
from tests.chaos.load import Load, Prompt
from tests.chaos.scenario import SETTLE_S, integrity_failures, settle
from tests.netns import poll_until

FD_SLACK = 3  # sockets a worker may have open or not at a given moment (a reconnect in progress)
JOB_LINE = re.compile(
    r"decode\[(\S+)\].*rid=(\S+) prefill job -> \S+: tokens \[\d+, \d+\), \d+ blocks, generation (\d+)"
)
REJECTED = re.compile(r'^pdserve:rejected_frames_total\{reason="(\w+)"\} (\S+)$', re.M)
# A write for a range that is gone is answered WriteRejected(stale), counted only by the KV receiver.
STALE = re.compile(r'^pdserve:kv_rejected_writes_total\{reason="stale"\} (\S+)$', re.M)
# The gateway's HTTP limits, short so the slowloris and the client that never reads are dropped soon.
# Room for the client that never reads: 8 completions of one request at once (its stream must outgrow
# every buffer between the gateway and the client, megabytes).
ENGINE = {"max_num_seqs": 8}
HTTP_LIMITS = {"http_header_timeout_s": 1.0, "http_body_timeout_s": 1.0, "http_write_timeout_s": 1.0}


@dataclass(slots=True)
class HostileResult:
    attack: str
    sent: int = 0  # hostile messages or connection attempts
    refused: Counter = field(default_factory=Counter)  # the victims' rejected_frames increase, by reason
    outcomes: Counter = field(default_factory=Counter)  # the ordinary requests meanwhile, by kind
    leaked_blocks: int = 0
    fd_growth: int = 0  # the most any worker's file descriptors stayed above their count
    failures: list[str] = field(default_factory=list)


class HostileCluster(ServeCluster):
    """The chaos tool's ``pdserve serve`` 2 + 2, with a cluster key file (an operator's), short HTTP
    limits and ENGINE."""

    def __init__(self, model: str, tmp, cluster_key: bool = True, gateway: dict | None = None):
        """``cluster_key`` False: no key configured, so pdserve serve makes a credential per member;
        ``gateway``: gateway fields on top of HTTP_LIMITS (the Responses store's URL)."""
        self.key_file = write_private_key() if cluster_key else ""
        transfer = {"transfer": {"cluster_key_file": self.key_file}} if cluster_key else {}
        super().__init__(model, tmp, engine=ENGINE, gateway={**HTTP_LIMITS, **(gateway or {})}, **transfer)

    def target(self, ctx: zmq.Context) -> attacks.Target:
        address = {w["id"]: w["address"] for w in self.workers()}
        worker_port = self.serve.config["gateway"]["worker_port"]
        return attacks.Target(
            ctx,
            self.key_file,
            f"tcp://127.0.0.1:{worker_port}",
            address["prefill-0"],
            address["decode-0"],
            self.url,
            self.model,
        )

    def rejections(self) -> Counter:
        """``pdserve:rejected_frames_total`` by reason, summed over the gateway and every worker, and the
        KV receivers' stale writes (``stale``)."""
        bodies = [httpx.get(f"{self.url}/metrics", timeout=5).text]
        bodies += [httpx.get(f"http://127.0.0.1:{self.serve.worker_http[w]}/metrics", timeout=5).text for w in WORKERS]
        total: Counter = collections.Counter()
        for body in bodies:
            for reason, value in REJECTED.findall(body):
                total[reason] += int(float(value))
            total["stale"] += sum(int(float(value)) for value in STALE.findall(body))
        return total

    def fds(self) -> dict[str, int]:
        return {w: len(os.listdir(f"/proc/{self.serve.worker_pid[w]}/fd")) for w in WORKERS}


def in_flight_job(cluster: HostileCluster, since: int) -> tuple[str, str, int] | None:
    """(decode worker, rid, transfer generation) of the latest prefill job logged after line ``since``."""
    for line in reversed(cluster.log[since:]):
        if m := JOB_LINE.search(line):
            return m.group(1), m.group(2), int(m.group(3))
    return None


def kv_address(cluster: HostileCluster, worker_id: str) -> str:
    return next(w["address"] for w in cluster.workers() if w["id"] == worker_id)


def forged_registration(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    result.sent = attacks.forged_registrations(t)


def identity_takeover(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    incarnation = cluster.serve.registered("decode-0")["incarnation"]
    result.sent = attacks.identity_takeover(t, "decode-0")
    if cluster.serve.registered("decode-0")["incarnation"] != incarnation:
        result.failures.append("decode-0's registration taken over")


def forged_tokens_and_kv(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """While the load runs: a whole fake answer for a request in flight, and KV writes, a commit and an
    abort for it, by a key holder that was not given it."""
    sock = attacks.register_bystander(t)
    try:
        for _ in range(3):
            since = len(cluster.log)
            job = poll_until(lambda: in_flight_job(cluster, since), 30, poll_s=0.01)
            if job is None:
                result.failures.append("no prefill job seen to forge frames for")
                return
            decode_worker, rid, generation = job
            result.sent += attacks.forged_tokens(sock, rid)
            sent, events = attacks.forged_kv(t, rid, generation, kv_address(cluster, decode_worker), BLOCK)
            result.sent += sent
            if any(e.ok for e in events):
                result.failures.append(f"a forged KV write for {rid} was taken")
    finally:
        attacks.leave(sock)


def replayed_frames(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """Writes for requests that are over, replayed: stale."""
    since = len(cluster.log)
    jobs = poll_until(lambda: (j := in_flight_job(cluster, since)) and [j], 30, poll_s=0.05)
    if not jobs:
        result.failures.append("no prefill job seen to replay")
        return
    decode_worker, rid, generation = jobs[0]
    poll_until(lambda: any(f"rid={rid} finished" in line for line in cluster.log[since:]), 30)
    for _ in range(3):
        sent, events = attacks.replayed_kv(t, rid, generation, kv_address(cluster, decode_worker), BLOCK)
        result.sent += sent
        if any(e.ok for e in events):
            result.failures.append(f"a replayed KV write for {rid} was taken")


def malformed_jobs_and_handshakes(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    result.sent, failed = attacks.malformed_jobs_and_handshakes(t, BLOCK)
    if len(failed) != result.sent:
        result.failures.append(f"{result.sent - len(failed)} hostile jobs got no PrefillFailed")


def fake_prefill_worker(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    """A key holder registered as a prefill worker that writes the KV of the jobs it gets and commits a
    first token outside the vocabulary: the decode workers refuse it, the gateway blames it (its breaker
    opens) and retries on a real prefill worker."""
    fake = hostile.FakePrefill(t.ctx, t.gateway, hostile.key_holder(t.key_file), BLOCK)
    try:
        poll_until(lambda: len(fake.events) >= 3, 60)
    finally:
        fake.close()
    result.sent = 1 + len(fake.events)
    if not fake.events:
        result.failures.append("the fake prefill worker got no job")


def slowloris_http(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    for _ in range(3):
        result.sent += 1
        if not attacks.slowloris(t.url):
            result.failures.append("a slowloris connection was never dropped")


def client_that_never_reads(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    def aborted_count() -> float:
        return cluster.metric("gateway", 'pdserve:requests_total{outcome="aborted"}')

    before = aborted_count()
    result.sent = 1
    if not attacks.never_reading_client(t.url, t.model, lambda: aborted_count() > before):
        result.failures.append("the stalled stream's request was never aborted")


def huge_grammar(cluster: HostileCluster, t: attacks.Target, result: HostileResult) -> None:
    for _ in range(3):
        result.sent += 1
        if attacks.huge_grammar(t.url, t.model).status_code != 400:
            result.failures.append("a huge grammar was not a 400")


ATTACKS = {
    "forged registration": forged_registration,
    "identity takeover": identity_takeover,
    "forged token events and KV writes": forged_tokens_and_kv,
    "replayed frames": replayed_frames,
    "malformed jobs and handshakes": malformed_jobs_and_handshakes,
    "fake prefill worker (poisoned KV)": fake_prefill_worker,
    "slowloris HTTP": slowloris_http,
    "client that never reads": client_that_never_reads,
    "huge grammar": huge_grammar,
}


def warm_up(cluster: HostileCluster, prompts: list[Prompt], num_requests: int = 24) -> None:
    """Ordinary load until every worker pair has connected (sockets, shm mappings): the file descriptors
    counted before an attack are those of a cluster in use."""
    load = Load(cluster.url, cluster.model, prompts).start()
    try:
        poll_until(lambda: len(load.outcomes) >= num_requests, 300, poll_s=0.1)
    finally:
        load.stop()


def run_attack(
    cluster: HostileCluster, attack: str, prompts: list[Prompt], table=None, restarts: frozenset = frozenset()
) -> HostileResult:
    """``table``: name -> attack (ATTACKS by default); ``restarts``: workers the attack kills itself."""
    table = table or ATTACKS
    result = HostileResult(attack)
    if not settle(cluster, SETTLE_S)[0]:
        result.failures.append("cluster not idle before the attack")
        return result
    pids, fds, refused = dict(cluster.serve.worker_pid), cluster.fds(), cluster.rejections()
    ctx = zmq.Context()
    load = Load(cluster.url, cluster.model, prompts).start()
    try:
        poll_until(lambda: load.outcomes, 60, poll_s=0.05)  # requests flowing
        table[attack](cluster, cluster.target(ctx), result)
        time.sleep(1.0)  # the load goes on a moment after the attack
    except Exception as exc:  # an attack that broke is a failed run, not a crashed tool
        result.failures.append(f"the attack raised {exc!r}")
    finally:
        result.outcomes = Counter(o.kind for o in load.stop())
        ctx.destroy(linger=0)
    result.failures += [f"{kind} request" for kind in result.outcomes if kind not in ("ok", "error")]
    if {w: p for w, p in cluster.serve.worker_pid.items() if w not in restarts} != {
        w: p for w, p in pids.items() if w not in restarts
    }:
        result.failures.append("a worker died and was restarted")
    registered = {w["id"] for w in cluster.workers()}
    if registered != set(WORKERS):
        result.failures.append(f"registered after the attack: {sorted(registered)}")
    idle, result.leaked_blocks = settle(cluster, SETTLE_S)
    if not idle:
        result.failures.append(f"not idle {SETTLE_S:.0f} s after the attack: {result.leaked_blocks} KV blocks in use")
    fds = {w: n for w, n in fds.items() if w not in restarts}  # a restarted worker is a new process
    poll_until(lambda: all(n <= fds[w] + FD_SLACK for w, n in cluster.fds().items() if w in fds), 30)
    result.fd_growth = max(0, *(n - fds[w] for w, n in cluster.fds().items() if w in fds))
    if result.fd_growth > FD_SLACK:
        result.failures.append(f"file descriptors grew by {result.fd_growth}")
    result.refused += cluster.rejections() - refused  # on top of what the attack counted itself
    result.failures += integrity_failures(cluster)
    return result
