"""One chaos scenario: a fault hits one member of a loaded 2 + 2 cluster at one phase of a request.

A run: wait until every member is registered and idle; start the load; wait for the phase on the
target; inject the fault (SIGSTOP and link-down are healed after OUTAGE_S, longer than the lease and the
gateway's worker timeout, so both expire); then check, and measure:
1. a killed worker is dropped from routing (gone from /v1/workers, or back with a new incarnation);
2. recovery: every worker registered again (a killed one with a new incarnation) and a request that
   started after that came back exact; time to recover = fault -> that answer;
3. the replacement (or the healed member) is picked up: it serves work again (prompts held back until
   then, which no worker has cached);
4. every request ended within its deadline with the exact reference text or a clear error (HTTP 5xx
   with an OpenAI error body; a refused or reset connection only when the gateway itself was hit);
5. once idle, every worker reports kv_blocks_in_use == 0, nothing running or waiting, nothing held
   for a peer, and has run its block-integrity check with no violation; what is still in use after
   SETTLE_S counts as leaked.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tests.chaos.clusters import DECODE, MAX_NUM_SEQS, PREFILL, WORKER_TIMEOUT_S, WORKERS
from tests.chaos.load import Load, Prompt
from tests.chaos.phases import PHASES, wait_for_phase
from tests.netns import poll_until

FAULTS = ("sigkill", "sigstop", "linkdown")
TARGETS = ("prefill", "decode", "gateway")
OUTAGE_S = 3.0
RECOVER_S = 90.0
SETTLE_S = 40.0  # past the gateway's 30 s request deadline: whatever a dead request held must be back
SERVED = {"prefill": "pdserve:prefill_jobs_total", "decode": "pdserve:request_success_total"}


@dataclass(frozen=True, slots=True)
class Scenario:
    fault: str
    target: str
    phase: str

    @property
    def name(self) -> str:
        return f"{self.fault} {self.target} @ {self.phase}"

    def member(self, run: int) -> str:
        """Runs alternate between the two workers of the target's pool."""
        return "gateway" if self.target == "gateway" else f"{self.target}-{run % 2}"


@dataclass(slots=True)
class RunResult:
    scenario: Scenario
    member: str
    outcomes: Counter = field(default_factory=Counter)  # kind -> requests
    failures: list[str] = field(default_factory=list)
    recover_s: float | None = None
    leaked_blocks: int = 0


def _incarnations(cluster) -> dict[str, str]:
    return {w["id"]: w["incarnation"] for w in cluster.workers()}


def _all_registered(cluster) -> dict[str, str] | None:
    found = _incarnations(cluster)
    return found if set(WORKERS) <= found.keys() else None


def run_once(cluster, scenario: Scenario, prompts: list[Prompt], run: int) -> RunResult:
    member = scenario.member(run)
    result = RunResult(scenario, member)
    if not poll_until(lambda: _all_registered(cluster), 120) or not settle(cluster, SETTLE_S)[0]:
        result.failures.append("cluster not whole and idle before the fault")
        return result
    before = _all_registered(cluster)
    pool = member.split("-")[0]
    # The second half is held back for after the fault: prompts no worker has cached, so the router
    # weighs load alone and the healed member gets its share. Repeats of the first half would all go
    # to the workers that cached them meanwhile (a fast prefill never backs up enough to spill over).
    warm, fresh = prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]
    load = Load(cluster.url, cluster.model, warm).start()
    try:
        nudge = (lambda: load.burst(queue_burst(warm))) if scenario.phase == "queued" else None
        if not wait_for_phase(cluster, member, scenario.phase, PREFILL, DECODE, nudge):
            result.failures.append(f"phase {scenario.phase} never observed on {member}")
        else:
            served_before = (
                0.0 if scenario.fault == "sigkill" or pool == "gateway" else cluster.metric(member, SERVED[pool])
            )
            faulted_at = time.monotonic()
            _inject(cluster, scenario, member, before, result)
            result.recover_s = _recover(cluster, scenario, member, before, load, faulted_at, result)
            load.send_from(fresh)
            if pool != "gateway" and not poll_until(lambda: cluster.metric(member, SERVED[pool]) > served_before, 30):
                result.failures.append(f"{member} not picked up again: served nothing after the fault")
    finally:
        outcomes = load.stop()
    result.outcomes = Counter(o.kind for o in outcomes)
    allowed = {"ok", "error"} | ({"disconnected"} if scenario.target == "gateway" else set())
    for o in outcomes:
        if o.kind not in allowed:
            result.failures.append(f"request {o.kind}: {o.detail}")
    idle, result.leaked_blocks = settle(cluster, SETTLE_S)
    if not idle:
        result.failures.append(f"not idle {SETTLE_S:.0f} s after the load: {result.leaked_blocks} KV blocks in use")
    result.failures += integrity_failures(cluster)
    return result


def queue_burst(prompts: list[Prompt]) -> list[Prompt]:
    """The longest prompts (the most prefill chunks each), three times as many as the prefill pool runs
    at once: two thirds of them must queue on a prefill worker while the first third computes."""
    return sorted(prompts, key=lambda p: len(p.token_ids), reverse=True)[: 3 * len(PREFILL) * MAX_NUM_SEQS]


def _inject(cluster, scenario: Scenario, member: str, before: dict[str, str], result: RunResult) -> None:
    cluster.fault(scenario.fault, member)
    if scenario.fault == "sigkill" and member != "gateway":
        dropped = poll_until(lambda: _incarnations(cluster).get(member) != before[member], WORKER_TIMEOUT_S + 5)
        if not dropped:
            result.failures.append(f"killed {member} still routed to {WORKER_TIMEOUT_S + 5:.0f} s after the kill")
    if scenario.fault != "sigkill":
        time.sleep(OUTAGE_S)
        cluster.heal(scenario.fault, member)


def _recover(
    cluster, scenario: Scenario, member: str, before: dict[str, str], load: Load, faulted_at: float, result: RunResult
) -> float | None:
    def whole() -> bool:
        now = _all_registered(cluster)
        return bool(now) and (scenario.fault != "sigkill" or member == "gateway" or now[member] != before[member])

    if not poll_until(whole, RECOVER_S):
        result.failures.append(f"not every worker registered again within {RECOVER_S:.0f} s")
        return None
    whole_at = time.monotonic()
    if not (first := poll_until(lambda: load.first_ok_since(whole_at), RECOVER_S, poll_s=0.02)):
        result.failures.append("no exact answer after every worker registered again")
        return None
    return first.ended - faulted_at


IDLE_GAUGES = (
    "pdserve:kv_blocks_in_use",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "pdserve:kv_blocks_held_for_peer",
)


def settle(cluster, timeout_s: float) -> tuple[bool, int]:
    """(idle, leaked): idle once every worker's own /metrics shows nothing in use, running, waiting or held
    for a peer; leaked = the KV blocks still in use when ``timeout_s`` ran out (0 when idle)."""

    def idle() -> bool:
        return all(cluster.metric(w, name) == 0 for w in WORKERS for name in IDLE_GAUGES)

    if poll_until(idle, timeout_s, poll_s=0.2):
        return True, 0
    return False, sum(int(_try(lambda w=w: cluster.metric(w, "pdserve:kv_blocks_in_use")) or 0) for w in WORKERS)


def _try(read):
    try:
        return read()
    except OSError:
        return None


def integrity_failures(cluster) -> list[str]:
    failures = []
    for w in WORKERS:
        if not poll_until(lambda w=w: cluster.metric(w, "pdserve:kv_integrity_checks_total") >= 1, 10):
            failures.append(f"{w} never ran its idle integrity check")
        if _try(lambda w=w: cluster.metric(w, "pdserve:kv_integrity_violations_total")) != 0:
            failures.append(f"{w}: block integrity violated")
    return failures


def matrix(faults=FAULTS, targets=TARGETS, phases=PHASES) -> list[Scenario]:
    return [Scenario(f, t, p) for f in faults for t in targets for p in phases]
