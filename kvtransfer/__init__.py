"""Moving paged KV blocks between nodes under an explicit, fenced ownership protocol.

- ``ownership``: the receiver's state machine per destination range (pure logic, injectable clock)
- ``receiver`` / ``sender``: the two ends, poll-based, over a ``channel`` (in-process or ZeroMQ)
- ``transports/``: one file per way the blocks travel (loopback, cuda_ipc, shm, zmq), chosen per pair at
  handshake from a registry; loopback's direct writes are guarded by per-block ``fence`` tokens; shm and
  cuda_ipc write a window per transfer (``shm_window``, ``cuda_window`` over ``window_arena``), copied into
  the pool only after the ownership check
- ``pool``: the KV pool as this package sees it (the engine's ``KVPool`` fits it; no engine import)
- ``compat``: the compatibility record checked at handshake; ``metrics``: Prometheus series
"""
