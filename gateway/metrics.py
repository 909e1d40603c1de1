"""The gateway's Prometheus metrics, in a registry per app (no process-global state).

Request-level series are vLLM's (``vllm:`` names, buckets and the ``model_name`` label), exported where a
request ends, which in P/D is here: one count per request whichever workers served it. The engine-level
ones (running, waiting, KV usage, prefix cache) are the workers' (worker/metrics.py); the gateway also
shows the first three per pool, summed from the workers' heartbeats at each scrape and labelled ``pool``
(``PoolEngineGauges``), so a vLLM dashboard or autoscaler pointed at this one endpoint reads them. The
``pool`` label is how a query tells them from the workers' own series when Prometheus scrapes both.
``pdserve:`` names what only P/D has: pools, routing, admission, the stores. ``process_*``: this
process's CPU, memory, fds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol.serving import ROLES, Heartbeat
from telemetry.buckets import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS, token_count_buckets

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(slots=True)
class ChoiceTiming:
    """One completion's life at the gateway (monotonic seconds), what the request histograms need."""

    queue_time_s: float  # as its worker reported it (0 when it did not)
    first_token_at: float | None  # None: no token came
    last_token_at: float | None
    num_output_tokens: int
    finish_reason: str | None  # "stop" | "length"; None: it did not finish (aborted, failed)


class GatewayMetrics:
    """Latency histograms, request outcomes and token counters of one gateway."""

    def __init__(self, model_name: str = "", max_model_len: int = 1 << 20) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        ProcessCollector(registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, ["model_name"], registry=r).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token, per choice.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive token events of a choice.", TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per choice "
            "(vLLM's older name; inter_token_latency_seconds per token).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to the last byte of the response.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited for a worker, as reported by it.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Leaving the queue to the first token (the prompt's prefill and its KV transfer), per choice.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First to last token of a choice.", REQUEST_LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Leaving the queue to the last token, per choice.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_count_buckets(max_model_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_count_buckets(max_model_len)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            "vllm:request_success",
            "Finished completions by finish reason (stop | length | abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):  # listed from the first scrape, as vLLM's are
            self.request_success.labels(model_name, reason)
        self.requests = Counter(
            "pdserve:requests", "Finished HTTP generation requests by outcome.", ["outcome"], registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pdserve:cached_prompt_tokens", "Prompt tokens served from a prefix cache (not recomputed).", registry=r
        )
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running", "Generation requests in flight in the gateway.", registry=r
        )
        # worker pools, as their heartbeats report them (labelled by role: prefill | decode)
        self.pool_workers = Gauge("pdserve:pool_workers", "Registered workers per pool.", ["role"], registry=r)
        self.pool_kv_cache_usage = Gauge(
            "pdserve:pool_kv_cache_usage_perc", "KV blocks in use / total over a pool (0..1).", ["role"], registry=r
        )
        self.pool_requests_running = Gauge(
            "pdserve:pool_num_requests_running", "Requests running on a pool's workers.", ["role"], registry=r
        )
        self.pool_requests_waiting = Gauge(
            "pdserve:pool_num_requests_waiting", "Requests waiting in a pool's workers.", ["role"], registry=r
        )
        self.admission_queue = Gauge(
            "pdserve:admission_queue_length",
            "Requests waiting in the gateway for room in a pool.",
            ["role"],
            registry=r,
        )
        self.route_decisions = Counter(
            "pdserve:route_decisions",
            "Routing decisions by policy and result (local | disaggregated | busy | no_capacity | queue_full | retry).",
            ["policy", "result"],
            registry=r,
        )
        self.worker_malformed_frames = Counter(
            "pdserve:worker_malformed_frames", "Frames from workers rejected by the codec (ignored).", registry=r
        )
        self.rejected_frames = Counter(
            "pdserve:rejected_frames",
            "Frames from workers refused, by reason (protocol/rejects.py: malformed, "
            "bad_proof, identity_taken, unregistered, not_assigned, handler_error).",
            ["reason"],
            registry=r,
        )
        # the Responses API's store (gateway/dialects/responses/store.py); read from it at each scrape
        self.stored_responses = Gauge(
            "pdserve:stored_responses", "Responses held for previous_response_id.", registry=r
        )
        self.stored_responses_bytes = Gauge(
            "pdserve:stored_responses_bytes", "Bytes the stored responses count for (their JSON).", registry=r
        )
        self.background_responses = Gauge(
            "pdserve:background_responses", "Background responses (Responses API) still running.", registry=r
        )
        self.workers_lost = Counter(
            "pdserve:workers_lost",
            "Workers removed from the registry, by reason (expired | goodbye).",
            ["reason"],
            registry=r,
        )
        self.workers_stuck = Counter(
            "pdserve:workers_stuck",
            "Workers taken out of rotation because one step of theirs ran past gateway.worker_step_timeout_s.",
            registry=r,
        )
        # the circuit breaker (gateway/workers/breaker.py), per registered worker; series go when it leaves
        self.worker_failures = Counter(
            "pdserve:worker_failures",
            "Failed attempts blamed on a worker (it left, or an error event named it the culprit).",
            ["worker_id"],
            registry=r,
        )
        self.worker_breaker_open = Gauge(
            "pdserve:worker_breaker_open",
            "1 while a worker's circuit breaker is open (it gets no new requests), else 0.",
            ["worker_id"],
            registry=r,
        )

    def report_pools(self, heartbeats: Callable[[], Iterable[Heartbeat]]) -> None:
        """Export vLLM's engine gauges per pool from ``heartbeats`` (the registry's latest, read at
        each scrape: no copy to keep current, no scrape of the workers)."""
        self.registry.register(PoolEngineGauges(self.model_name, heartbeats))

    def observe_choices(self, arrival: float, timings: list[ChoiceTiming], aborted: bool) -> None:
        """A request's per-completion histograms and finish reasons, once it is over."""
        for t in timings:
            reason = t.finish_reason or ("abort" if aborted else None)
            if reason is not None:
                self.request_success.labels(self.model_name, reason).inc()
            if t.first_token_at is None:
                continue
            started = arrival + t.queue_time_s
            self.request_prefill_time.observe(max(t.first_token_at - started, 0.0))
            self.request_decode_time.observe(t.last_token_at - t.first_token_at)
            self.request_inference_time.observe(max(t.last_token_at - started, 0.0))
            if t.num_output_tokens > 1:
                self.time_per_output_token.observe((t.last_token_at - t.first_token_at) / (t.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolEngineGauges:
    """``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` with
    ``model_name`` and ``pool`` (prefill | decode), as one vLLM server of that pool would report them:
    requests summed over the pool's workers, KV usage as blocks in use over the pool's blocks (the
    workers' own definition, worker/metrics.py). Both pools are listed from the first scrape, at 0
    while a pool has no worker."""

    FAMILIES = (
        ("num_requests_running", "Requests in the running batches of a pool's workers (their heartbeats)."),
        ("num_requests_waiting", "Requests queued on a pool's workers, incl. waiting for KV (their heartbeats)."),
        ("kv_cache_usage_perc", "KV blocks in use / total over a pool's workers, 0..1 (their heartbeats)."),
    )

    def __init__(self, model_name: str, heartbeats: Callable[[], Iterable[Heartbeat]]):
        self._model_name = model_name
        self._heartbeats = heartbeats

    def describe(self) -> list[GaugeMetricFamily]:  # the names, for the registry's duplicate check
        return [GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name", "pool"]) for name, doc in self.FAMILIES]

    def collect(self) -> list[GaugeMetricFamily]:
        running, waiting, usage = self.describe()
        heartbeats = list(self._heartbeats())
        for pool in ROLES:
            members = [hb for hb in heartbeats if hb.role == pool]
            total = sum(hb.kv_blocks_total for hb in members)
            labels = [self._model_name, pool]
            running.add_metric(labels, sum(hb.num_running for hb in members))
            waiting.add_metric(labels, sum(hb.num_waiting for hb in members))
            usage.add_metric(labels, sum(hb.kv_blocks_in_use for hb in members) / total if total else 0.0)
        return [running, waiting, usage]
