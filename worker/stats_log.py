"""vLLM's periodic engine line, per worker, from the worker's own Prometheus series:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 3 reqs,
    Waiting: 0 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.0%

Throughputs and the hit rate are over the interval since the last line; a line is written every
``interval_s`` while there was activity (tokens moved, or requests running or waiting), so an idle
worker stays quiet. Reading the registry (not the engine) keeps the line and /metrics in agreement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

log = logging.getLogger("pdserve.stats")

STATS_INTERVAL_S = 10.0


class StatsLog:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        prompt_series: str,
        interval_s: float = STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._registry = registry
        self._labels = {"model_name": model_name}
        self._prompt_series = prompt_series  # what counts as prompt work on this node
        self._interval_s = interval_s
        self._clock = clock
        self._last_at = clock()
        self._last = self._totals()

    def _value(self, name: str, labels: dict | None = None) -> float:
        return self._registry.get_sample_value(name, labels or {}) or 0.0

    def _totals(self) -> tuple[float, float, float, float]:
        return (
            self._value(self._prompt_series),
            self._value("pdserve:generation_tokens_total"),
            self._value("vllm:prefix_cache_queries_total", self._labels),
            self._value("vllm:prefix_cache_hits_total", self._labels),
        )

    def tick(self) -> str | None:
        """The line, logged, when one is due and there was activity; else None."""
        now = self._clock()
        if now - self._last_at < self._interval_s:
            return None
        totals, elapsed = self._totals(), now - self._last_at
        prompt, generated, queries, hits = (t - last for t, last in zip(totals, self._last))
        self._last, self._last_at = totals, now
        running = self._value("vllm:num_requests_running", self._labels)
        waiting = self._value("vllm:num_requests_waiting", self._labels)
        if not (prompt or generated or running or waiting):
            return None
        usage = self._value("vllm:kv_cache_usage_perc", self._labels)
        line = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
            f"{generated / elapsed:.1f} tokens/s, Running: {running:.0f} reqs, Waiting: {waiting:.0f} reqs, "
            f"KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {hits / queries * 100 if queries else 0:.1f}%"
        )
        log.info("%s", line)
        return line
