"""The gateway's Prometheus metrics, in a registry per app (no process-global state).

Names follow vLLM where the meaning matches, under the ``pdserve:`` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    """Latency histograms, request outcomes and token counters of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds", "Arrival to first generated token, per choice.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds", "Time between consecutive token events of a choice.",
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds", "Arrival to the last byte of the response.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "pdserve:request_queue_time_seconds", "Time a request waited for a worker, as reported by it.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(
            "pdserve:requests", "Finished HTTP generation requests by outcome.", ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", registry=r)
        self.cached_prompt_tokens = Counter(
            "pdserve:cached_prompt_tokens", "Prompt tokens served from a prefix cache (not recomputed).",
            registry=r)
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running", "Generation requests in flight in the gateway.", registry=r)
        # worker pools, as their heartbeats report them (labelled by role: prefill | decode)
        self.pool_workers = Gauge("pdserve:pool_workers", "Registered workers per pool.", ["role"], registry=r)
        self.pool_kv_cache_usage = Gauge(
            "pdserve:pool_kv_cache_usage_perc", "KV blocks in use / total over a pool (0..1).", ["role"], registry=r)
        self.pool_requests_running = Gauge(
            "pdserve:pool_num_requests_running", "Requests running on a pool's workers.", ["role"], registry=r)
        self.pool_requests_waiting = Gauge(
            "pdserve:pool_num_requests_waiting", "Requests waiting in a pool's workers.", ["role"], registry=r)
        self.admission_queue = Gauge(
            "pdserve:admission_queue_length", "Requests waiting in the gateway for room in a pool.", ["role"],
            registry=r)
        self.route_decisions = Counter(
            "pdserve:route_decisions", "Routing decisions by policy and result "
            "(local | disaggregated | busy | no_capacity | queue_full | retry).", ["policy", "result"],
            registry=r)
        self.worker_malformed_frames = Counter(
            "pdserve:worker_malformed_frames", "Frames from workers rejected by the codec (ignored).", registry=r)
        self.rejected_frames = Counter(
            "pdserve:rejected_frames", "Frames from workers refused, by reason (protocol/rejects.py: malformed, "
            "bad_proof, identity_taken, unregistered, not_assigned, handler_error).", ["reason"], registry=r)
        # the Responses API's store (gateway/response_store.py); read from it at each scrape
        self.stored_responses = Gauge("pdserve:stored_responses", "Responses held for previous_response_id.",
                                      registry=r)
        self.stored_responses_bytes = Gauge(
            "pdserve:stored_responses_bytes", "Bytes the stored responses count for (their JSON).", registry=r)
        self.background_responses = Gauge(
            "pdserve:background_responses", "Background responses (Responses API) still running.", registry=r)
        self.workers_lost = Counter(
            "pdserve:workers_lost", "Workers removed from the registry, by reason (expired | goodbye).", ["reason"],
            registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
