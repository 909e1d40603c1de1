"""The prefill worker's Prometheus series: the shared engine set, the transfer plane, and its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.sched.scheduler import Scheduler
from kvtransfer.metrics import TransferMetrics
from worker.metrics import EngineMetrics, EngineSnapshot


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = ""):
        self.registry = registry
        self.engine = EngineMetrics(registry, model_name, prompt_series="pdserve:prefill_computed_tokens_total")
        self.transfer = TransferMetrics(registry)
        self.jobs = Counter("pdserve:prefill_jobs", "Prefill jobs received", registry=registry)
        self.jobs_rejected = Counter(
            "pdserve:prefill_jobs_rejected",
            "Prefill jobs refused or failed (PrefillFailed sent)",
            ["reason"],
            registry=registry,
        )
        self.jobs_aborted = Counter("pdserve:prefill_jobs_aborted", "Prefill jobs aborted by a peer", registry=registry)
        self.malformed_frames = Counter(
            "pdserve:prefill_malformed_frames",
            "Frames on the job socket that were not a valid record",
            registry=registry,
        )
        self.computed_tokens = Counter(
            "pdserve:prefill_computed_tokens", "Prompt tokens run through the model", registry=registry
        )
        self.queued_tokens = Gauge(  # the prefill pool's autoscaling signal
            "pdserve:prefill_queued_tokens",
            "Prompt tokens queued or still to compute on this worker",
            registry=registry,
        )

    def update(self, scheduler: Scheduler, num_queued: int, num_transferring: int, queued_tokens: int) -> None:
        self.queued_tokens.set(queued_tokens)
        self.engine.update(EngineSnapshot.read(scheduler, scheduler.block_manager, num_transferring, num_queued))
