"""Moving paged KV blocks between nodes under an explicit, fenced ownership protocol.

- ``ownership``: the receiver's state machine per destination range (pure logic, injectable clock)
- ``receiver`` / ``sender``: the two ends, poll-based, over a ``channel`` (in-process or ZeroMQ)
- transports chosen per pair at handshake: loopback, shm (``shm_pool``), cuda_ipc (``cuda_ipc``), zmq;
  direct writes are guarded by per-block ``fence`` tokens
- ``compat``: the compatibility record and hash checked at handshake; ``metrics``: Prometheus series
"""
