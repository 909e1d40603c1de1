"""Live prefill and decode workers, fed by their wire heartbeats; pure bookkeeping, no I/O.

A worker appears with its first ``protocol.serving.Heartbeat`` and disappears after ``max_missed``
heartbeat intervals of silence (or at once on Goodbye), so pools grow and shrink without a restart.
A heartbeat with a new incarnation id means the process restarted: everything known about its cache is
void. A draining worker stays listed (its in-flight requests still stream) but gets nothing new.

Silence and a wedged loop are told apart. Workers heartbeat from a thread of their own (worker/liveness.py),
so a worker in a long step keeps heartbeating and stays registered; a silent one is gone (its process, its
host or the network). Each heartbeat also says how long the worker's current step has run: one that has
run past ``step_timeout_s`` (a step that never ends: a deadlock, a hung kernel) makes the worker *stuck*.
A stuck worker stays listed but takes nothing new, and the gateway fails what it holds
(gateway/workers/zmq_backend.py); once a heartbeat shows the step ended, it is back in rotation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.serving import Heartbeat


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class WorkerInfo:
    """The last heartbeat of one worker and when it arrived; load figures are the heartbeat's."""

    heartbeat: Heartbeat
    last_seen: float  # monotonic time of the last heartbeat
    is_stuck: bool = False  # its step ran past the registry's step timeout (set by ``check_stuck``)

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    @property
    def role(self) -> Role:
        return Role(self.heartbeat.role)

    @property
    def address(self) -> str:
        return self.heartbeat.address

    @property
    def incarnation(self) -> str:
        return self.heartbeat.incarnation

    @property
    def is_draining(self) -> bool:
        return self.heartbeat.draining

    @property
    def kv_blocks_free(self) -> int:
        return self.heartbeat.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        hb = self.heartbeat
        return hb.kv_blocks_in_use / hb.kv_blocks_total if hb.kv_blocks_total else 1.0

    @property
    def num_requests(self) -> int:
        return self.heartbeat.num_running + self.heartbeat.num_waiting

    def step_age(self, now: float) -> float:
        """How long the worker's current step has run by ``now``: what its last heartbeat said, plus the
        time since (0 when that heartbeat came between steps)."""
        running = self.heartbeat.step_running_s
        return running + (now - self.last_seen) if running > 0 else 0.0

    def as_json(self) -> dict:
        hb = self.heartbeat
        return {
            "id": hb.worker_id,
            "role": hb.role,
            "address": hb.address,
            "incarnation": hb.incarnation,
            "draining": hb.draining,
            "stuck": self.is_stuck,
            "steps_completed": hb.steps_completed,
            "step_running_s": round(hb.step_running_s, 3),
            "block_size": hb.block_size,
            "lora_names": list(hb.lora_names),
            "hot_lora_names": list(hb.hot_lora_names),
            "load": {
                "num_running": hb.num_running,
                "num_waiting": hb.num_waiting,
                "queued_prefill_tokens": hb.queued_prefill_tokens,
                "kv_blocks_in_use": hb.kv_blocks_in_use,
                "kv_blocks_free": hb.kv_blocks_free,
                "kv_blocks_total": hb.kv_blocks_total,
            },
        }


class WorkerRegistry:
    def __init__(self, heartbeat_interval_s: float = 1.0, max_missed: int = 3, step_timeout_s: float = 0.0) -> None:
        """``step_timeout_s``: a step running longer makes its worker stuck (0: never)."""
        assert heartbeat_interval_s > 0 and max_missed >= 1 and step_timeout_s >= 0
        self.timeout_s = heartbeat_interval_s * max_missed
        self.step_timeout_s = step_timeout_s
        self._workers: dict[str, WorkerInfo] = {}

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the worker is new or restarted (its cache is empty)."""
        known = self._workers.get(hb.worker_id)
        restarted = known is None or known.incarnation != hb.incarnation
        # Stuck until ``check_stuck`` sees the step ended, so that it reports the recovery once.
        self._workers[hb.worker_id] = WorkerInfo(hb, now, is_stuck=not restarted and known.is_stuck)
        return restarted

    def check_stuck(self, now: float) -> tuple[list[str], list[str]]:
        """(workers that became stuck, workers whose stuck step ended) since the last call."""
        became, recovered = [], []
        if self.step_timeout_s <= 0:
            return became, recovered
        for w in self._workers.values():
            stuck = w.step_age(now) > self.step_timeout_s
            if stuck != w.is_stuck:
                (became if stuck else recovered).append(w.worker_id)
                w.is_stuck = stuck
        return became, recovered

    def expire(self, now: float) -> list[str]:
        """Drop workers silent for longer than the timeout; returns their ids."""
        dead = [w.worker_id for w in self._workers.values() if now - w.last_seen > self.timeout_s]
        for worker_id in dead:
            del self._workers[worker_id]
        return dead

    def remove(self, worker_id: str) -> bool:
        """A worker said goodbye (clean drain); True if it was known."""
        return self._workers.pop(worker_id, None) is not None

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Workers ordered by id, so policies that scan them are deterministic."""
        return sorted((w for w in self._workers.values() if role is None or w.role == role), key=lambda w: w.worker_id)

    def accepting(self, role: Role) -> list[WorkerInfo]:
        """Workers of ``role`` that take new requests (not draining, not stuck)."""
        return [w for w in self.workers(role) if not w.is_draining and not w.is_stuck]
