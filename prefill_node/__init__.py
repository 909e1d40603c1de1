"""The prefill worker: chunked prefill for decode workers, KV pushed per chunk (see server.py)."""
