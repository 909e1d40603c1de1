"""When a request is in a given phase on the member a fault will hit, read from the workers' own
/metrics (polled every 20 ms; the fault follows the first reading that shows the phase).

Under a steady load several requests are in flight at once, so while one is in the phase under test
others are in other phases: "prefill-0 at transferring" means at least one request was in that phase
on prefill-0 at the fault, not that it was the only one. Prefill pushes each chunk's KV as soon as it
is computed, so prefilling and transferring overlap; transferring is told apart by a prompt whose
compute is done but whose blocks are still pinned for (or being written to) a decode worker.

| phase        | on a prefill worker P                     | on a decode worker D                               |
|--------------|-------------------------------------------|----------------------------------------------------|
| queued       | P has a job waiting (num_requests_waiting) | D holds a reservation and a prefill job is waiting |
| prefilling   | P has prompt tokens still to compute       | D holds a reservation and a prefill worker computes |
| transferring | P holds blocks and D holds blocks for P    | D holds blocks for a prefill peer and has waiting   |
|              | with nothing left to compute on P          | requests (reserved, KV not yet committed)          |
| decoding     | a decode worker is decoding                | D runs a decode batch (num_requests_running)        |

The gateway holds every request, so a gateway fault's phase is the first column's on any worker.

A phase the steady load reaches only by chance is reached by construction instead (``nudge``, called
at the start and again while the phase is not seen). Queued is one: the load repeats its prompts, which
the workers soon hold in their prefix caches, so a prefill job is computed in a step or two and a job
waits on a prefill worker only when several happen to arrive together. On a loaded machine (2 cores,
load average 8) that window was missed for 30 s in 2 of 3 runs. Its nudge sends a burst of prompts no
cache holds (Load.burst), more than the prefill pool runs at once: the excess waits on a prefill worker
for as long as the first of them take to compute, chunk by chunk, however slow the machine is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASES = ("queued", "prefilling", "transferring", "decoding")
POLL_S = 0.02
NUDGE_EVERY_S = 15.0  # the next burst only if the last one's queue was not seen (it should not happen)


VLLM_NAMED = ("num_requests_running", "num_requests_waiting")  # the engine gauges under vLLM's names


def _m(cluster, member: str, name: str) -> float:
    return cluster.metric(member, f"{'vllm' if name in VLLM_NAMED else 'pdserve'}:{name}")


def _on_prefill(cluster, p: str, phase: str, decoders: list[str]) -> bool:
    if phase == "queued":
        return _m(cluster, p, "num_requests_waiting") > 0
    if phase == "prefilling":
        return _m(cluster, p, "prefill_queued_tokens") > 0 and _m(cluster, p, "num_requests_running") > 0
    if phase == "transferring":
        return (
            _m(cluster, p, "num_requests_running") > 0
            and _m(cluster, p, "prefill_queued_tokens") == 0
            and _m(cluster, p, "kv_blocks_in_use") > 0
            and any(_m(cluster, d, "kv_blocks_held_for_peer") > 0 for d in decoders)
        )
    return any(_m(cluster, d, "num_requests_running") > 0 for d in decoders)


def _on_decode(cluster, d: str, phase: str, prefillers: list[str]) -> bool:
    if phase == "decoding":
        return _m(cluster, d, "num_requests_running") > 0
    if _m(cluster, d, "kv_blocks_held_for_peer") == 0:
        return False
    if phase == "queued":
        return any(_m(cluster, p, "num_requests_waiting") > 0 for p in prefillers)
    if phase == "prefilling":
        return any(_m(cluster, p, "prefill_queued_tokens") > 0 for p in prefillers)
    return _m(cluster, d, "num_requests_waiting") > 0


def in_phase(cluster, member: str, phase: str, prefillers: list[str], decoders: list[str]) -> bool:
    try:
        if member.startswith("prefill"):
            return _on_prefill(cluster, member, phase, decoders)
        if member.startswith("decode"):
            return _on_decode(cluster, member, phase, prefillers)
        return any(_on_prefill(cluster, p, phase, decoders) for p in prefillers)
    except OSError:
        return False  # a member between incarnations: not yet


def wait_for_phase(
    cluster,
    member: str,
    phase: str,
    prefillers: list[str],
    decoders: list[str],
    nudge: Callable[[], None] | None = None,
    timeout_s: float = 60.0,
) -> bool:
    """True once the phase is read on ``member``; False after ``timeout_s`` (a hang detector: with a
    ``nudge`` the phase is there within a few steps of the first one)."""
    give_up = time.monotonic() + timeout_s
    nudged_at = float("-inf")
    while time.monotonic() < give_up:
        if nudge is not None and time.monotonic() - nudged_at >= NUDGE_EVERY_S:
            nudge()
            nudged_at = time.monotonic()
        if in_phase(cluster, member, phase, prefillers, decoders):
            return True
        time.sleep(POLL_S)
    return False
