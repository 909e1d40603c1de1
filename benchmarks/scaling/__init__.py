"""Scaling curves: throughput and latency against concurrency and prompt length (`python -m benchmarks.scaling`)."""
