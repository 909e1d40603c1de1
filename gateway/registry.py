"""Live prefill and decode workers, fed by their heartbeats; pure bookkeeping, no I/O.

A worker appears with its first heartbeat and disappears after ``max_missed`` heartbeat intervals of
silence, so pools grow and shrink without a restart. A heartbeat with a new incarnation id means the
process restarted: everything known about its cache is void.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class WorkerLoad:
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued in the worker
    queued_prefill_tokens: int = 0  # prompt tokens still to prefill (prefill workers)
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.kv_blocks_in_use <= self.kv_blocks_total, (self.kv_blocks_in_use, self.kv_blocks_total)

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_in_use

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_in_use / self.kv_blocks_total


@dataclass(slots=True)
class Heartbeat:
    worker_id: str
    role: Role
    address: str  # where the gateway (or a peer) reaches the worker, e.g. tcp://10.0.0.5:7100
    incarnation: str  # new on every process start
    load: WorkerLoad = field(default_factory=WorkerLoad)


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    role: Role
    address: str
    incarnation: str
    load: WorkerLoad
    last_seen: float  # monotonic time of the last heartbeat

    def as_json(self) -> dict:
        load = self.load
        return {"id": self.worker_id, "role": self.role.value, "address": self.address,
                "incarnation": self.incarnation,
                "load": {"num_running": load.num_running, "num_waiting": load.num_waiting,
                         "queued_prefill_tokens": load.queued_prefill_tokens,
                         "kv_blocks_in_use": load.kv_blocks_in_use, "kv_blocks_total": load.kv_blocks_total}}


class WorkerRegistry:
    def __init__(self, heartbeat_interval_s: float = 1.0, max_missed: int = 3) -> None:
        assert heartbeat_interval_s > 0 and max_missed >= 1
        self.timeout_s = heartbeat_interval_s * max_missed
        self._workers: dict[str, WorkerInfo] = {}

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the worker is new or restarted (its cache is empty)."""
        known = self._workers.get(hb.worker_id)
        self._workers[hb.worker_id] = WorkerInfo(hb.worker_id, hb.role, hb.address, hb.incarnation, hb.load, now)
        return known is None or known.incarnation != hb.incarnation

    def expire(self, now: float) -> list[str]:
        """Drop workers silent for longer than the timeout; returns their ids."""
        dead = [w.worker_id for w in self._workers.values() if now - w.last_seen > self.timeout_s]
        for worker_id in dead:
            del self._workers[worker_id]
        return dead

    def remove(self, worker_id: str) -> None:
        """A worker said goodbye (clean drain)."""
        self._workers.pop(worker_id, None)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Workers ordered by id, so policies that scan them are deterministic."""
        return sorted((w for w in self._workers.values() if role is None or w.role == role),
                      key=lambda w: w.worker_id)
