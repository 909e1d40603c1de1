"""Prometheus metrics of the transfer plane, registered in a registry the node passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtransfer.copy_timing import TransferTimes

_BYTE_BUCKETS = tuple(float(1 << p) for p in range(16, 31, 2))  # 64 KiB .. 1 GiB
_SECOND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BANDWIDTH_BUCKETS = tuple(float(1 << p) for p in range(24, 38, 1))  # 16 MiB/s .. 128 GiB/s


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.transfer_bytes = Histogram(
            "pdserve:kv_transfer_bytes",
            "KV bytes moved per committed transfer",
            ["transport"],
            buckets=_BYTE_BUCKETS,
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "pdserve:kv_transfer_seconds",
            "First write to commit, per transfer",
            ["transport"],
            buckets=_SECOND_BUCKETS,
            registry=registry,
        )
        self.transfer_bandwidth = Histogram(
            "pdserve:kv_transfer_bandwidth_bytes_per_second",
            "Bytes / seconds per transfer",
            ["transport"],
            buckets=_BANDWIDTH_BUCKETS,
            registry=registry,
        )
        # The sender's view of each committed transfer (kvtransfer/copy_timing.py): the copy alone,
        # the tail a request's TTFT waits for after its last prefill chunk, and the whole span.
        self.copy_seconds = Histogram(
            "pdserve:kv_transfer_copy_seconds",
            "Block copies of a transfer, timed around the copy (CUDA events on CUDA)",
            ["transport"],
            buckets=_SECOND_BUCKETS,
            registry=registry,
        )
        self.copy_bytes = Counter(
            "pdserve:kv_transfer_copy_bytes",
            "Bytes the sender copied for committed transfers",
            ["transport"],
            registry=registry,
        )
        self.exposed_seconds = Histogram(
            "pdserve:kv_transfer_exposed_seconds",
            "Commit (last prefill chunk done) to the receiver's acknowledgement, per transfer",
            ["transport"],
            buckets=_SECOND_BUCKETS,
            registry=registry,
        )
        self.span_seconds = Histogram(
            "pdserve:kv_transfer_span_seconds",
            "First block sent to the receiver's acknowledgement, per transfer",
            ["transport"],
            buckets=_SECOND_BUCKETS,
            registry=registry,
        )
        self.failed_transfers = Counter(
            "pdserve:kv_transfer_failures", "Transfers that did not commit", ["side", "reason"], registry=registry
        )
        self.expired_leases = Counter("pdserve:kv_lease_expired", "Reservations whose lease ran out", registry=registry)
        self.unreleased_windows = Counter(
            "pdserve:kv_windows_unreleased",
            "cuda_ipc windows freed, never reused, because their sender did not release them in time",
            registry=registry,
        )
        self.rejected_writes = Counter(
            "pdserve:kv_rejected_writes",
            "Writes/commits refused: stale generation, unknown incarnation...",
            ["reason"],
            registry=registry,
        )
        self.malformed_frames = Counter(
            "pdserve:kv_malformed_frames", "Frames rejected before decoding into a record", registry=registry
        )
        self.blocks_held_for_peer = Gauge(
            "pdserve:kv_blocks_held_for_peer", "Blocks reserved for incoming transfers", registry=registry
        )
        self.handshakes = Counter("pdserve:kv_handshakes", "Handshakes by result", ["result"], registry=registry)
        # Every frame this process refused from a peer, by reason (protocol/rejects.py); the node's server
        # loop and its transfer plane count here alike.
        self.rejected_frames = Counter(
            "pdserve:rejected_frames", "Frames from peers refused, by reason", ["reason"], registry=registry
        )

    def count_rejected(self, reason: str) -> None:
        self.rejected_frames.labels(reason).inc()

    def observe_sent(self, transport: str, times: TransferTimes, acked_at: float) -> None:
        """A committed transfer on the sender; ``acked_at`` on the perf_counter clock of ``times``."""
        self.copy_seconds.labels(transport).observe(times.copy_s)
        self.copy_bytes.labels(transport).inc(times.copied_bytes)
        if times.commit_at is not None:
            self.exposed_seconds.labels(transport).observe(max(acked_at - times.commit_at, 0.0))
        if times.started_at is not None:
            self.span_seconds.labels(transport).observe(max(acked_at - times.started_at, 0.0))

    def observe_transfer(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(transport).observe(num_bytes)
        self.transfer_seconds.labels(transport).observe(seconds)
        if seconds > 0:
            self.transfer_bandwidth.labels(transport).observe(num_bytes / seconds)
