"""The engine-side series every node exports: vLLM's names (``vllm:``, label ``model_name``) where the
meaning is vLLM's (running, waiting, KV usage, prefix cache, preemptions); ``pdserve:`` for the rest,
which are per node (a request counts at its prefill and at its decode worker; the gateway's ``vllm:``
request series count it once). Plus ``process_*`` (CPU, memory, fds) of this process.

Torch-free on purpose: ``update`` takes plain numbers, so either node (and tests) can feed it.
Counters that the engine keeps as running totals (prefix cache tokens, preemptions) are advanced by
the difference since the last update, so Prometheus sees monotonic counters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from worker.stats_log import StatsLog

log = logging.getLogger(__name__)
INTEGRITY_CHECK_INTERVAL_S = 1.0

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class EngineSnapshot:
    """Totals read from a node's block manager and scheduler at one moment."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_in_use: int  # referenced by live requests or reservations (excludes evictable cache)
    kv_blocks_free: int  # free + evictable cached
    prefix_query_tokens: int  # running totals since start
    prefix_hit_tokens: int
    num_preemptions: int
    kv_live_slots: int = 0  # slots of in-use blocks holding a live token (BlockManager.num_live_slots)
    block_size: int = 0

    @classmethod
    def read(cls, scheduler, block_manager, num_running_outside: int = 0, num_waiting_outside: int = 0):
        """The engine's totals now; ``*_outside``: a node's requests the scheduler does not hold (queued
        before admission, awaiting KV, transferring), counted in with the scheduler's own."""
        bm = block_manager
        return cls(
            num_running=scheduler.num_running + num_running_outside,
            num_waiting=scheduler.num_waiting + num_waiting_outside,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_in_use=bm.num_in_use_blocks,
            kv_blocks_free=bm.num_allocatable_blocks,
            prefix_query_tokens=bm.num_prefix_query_tokens,
            prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            kv_live_slots=bm.num_live_slots,
            block_size=bm.block_size,
        )


class EngineMetrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str = "", prompt_series: str = "pdserve:prompt_tokens_total"
    ):
        """``prompt_series``: the counter of prompt work on this node, for the periodic stats line."""
        ProcessCollector(registry=registry)  # every worker registry gets one EngineMetrics

        def vllm_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vllm:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        def vllm_counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve:{name}", doc, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pdserve:{name}", doc, labels, registry=registry)

        self.num_requests_running = vllm_gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = vllm_gauge("num_requests_waiting", "Requests queued (incl. waiting for KV)")
        self.kv_cache_usage_perc = vllm_gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1")
        self.kv_blocks_in_use = gauge("kv_blocks_in_use", "KV blocks referenced by live requests or reservations")
        self.kv_blocks_free = gauge("kv_blocks_free", "KV blocks free or evictable")
        self.kv_blocks_total = gauge("kv_blocks_total", "KV blocks in the pool")
        self.kv_live_slots = gauge("kv_live_slots", "Token slots of in-use KV blocks that hold a live token")
        self.kv_slot_utilization = gauge(
            "kv_slot_utilization", "Live tokens / slots of in-use KV blocks, 0..1 (0 when none is in use)"
        )
        self.prefix_cache_queries = vllm_counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = vllm_counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = vllm_counter("num_preemptions", "Sequences preempted (recomputed later)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter("request_success", "Finished requests", ("finished_reason",))
        self.request_failure = counter("request_failure", "Requests failed or refused", ("reason",))
        self.step_errors = counter(
            "engine_step_errors", "Engine steps that raised: their requests failed, the loop went on"
        )
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Arrival to first token on this node",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Between a completion's consecutive tokens",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Arrival to finish on this node",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.kv_integrity_checks = counter(
            "kv_integrity_checks", "Idle checks of the block invariant (free + cached + in_use == total, one owner)"
        )
        self.kv_integrity_violations = counter("kv_integrity_violations", "Idle checks that found the invariant broken")
        self._last_integrity_check = float("-inf")
        self._checked_fingerprint: tuple | None = None
        self._last = EngineSnapshot(0, 0, 0, 0, 0, 0, 0, 0)
        self.stats = StatsLog(registry, model_name, prompt_series)

    def update(self, s: EngineSnapshot) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_blocks_in_use.set(s.kv_blocks_in_use)
        self.kv_blocks_free.set(s.kv_blocks_free)
        self.kv_blocks_total.set(s.kv_blocks_total)
        self.kv_cache_usage_perc.set(s.kv_blocks_in_use / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self.kv_live_slots.set(s.kv_live_slots)
        slots = s.kv_blocks_in_use * s.block_size
        self.kv_slot_utilization.set(s.kv_live_slots / slots if slots else 0.0)
        last = self._last
        self.prefix_cache_queries.inc(max(s.prefix_query_tokens - last.prefix_query_tokens, 0))
        self.prefix_cache_hits.inc(max(s.prefix_hit_tokens - last.prefix_hit_tokens, 0))
        self.num_preemptions.inc(max(s.num_preemptions - last.num_preemptions, 0))
        self._last = s
        self.stats.tick()

    def check_integrity_if_idle(self, block_manager, is_idle: bool, now: float) -> None:
        """When the node is idle, at most once a second, run the block manager's invariant check and
        count the result: what tests and alerts read to know no block leaked or is owned twice."""
        if not is_idle or now - self._last_integrity_check < INTEGRITY_CHECK_INTERVAL_S:
            return
        # The walk is O(pool): skip it while nothing moved since the last one.
        fingerprint = (
            block_manager.num_free_blocks,
            block_manager.num_cached_blocks,
            block_manager.num_prefix_query_tokens,
            block_manager.num_evicted_blocks,
        )
        if fingerprint == self._checked_fingerprint:
            return
        self._checked_fingerprint = fingerprint
        self._last_integrity_check = now
        self.kv_integrity_checks.inc()
        try:
            block_manager.check_integrity()
        except AssertionError as exc:
            self.kv_integrity_violations.inc()
            log.error("KV block integrity violated: %s", exc)
