"""Plumbing shared by the prefill and decode worker processes (torch-free).

- ``WorkerSocket``: the DEALER to one gateway's ROUTER (identity = worker id); typed records in and out
- ``GatewayLinks``: one WorkerSocket per gateway (several gateways share a pool), gateways lost noticed
- ``HeartbeatTimer``: when the next Heartbeat is due
- ``Liveness`` / ``StepWatch``: heartbeats that a long step cannot stop (a thread repeats the loop's last
  one while the loop is late), each saying how long the loop's current step has run
- ``serve_http``: /metrics (Prometheus), /health, /ready on a daemon thread
- ``EngineMetrics``: the vLLM-named gauges and counters every node exports (``pdserve:`` prefix)
- ``install_drain``: SIGTERM -> the node's drain handler; ``Drain``: requested -> started -> over
- ``setup_logging``: one log format for every worker, request ids as ``rid=...``
- ``default_worker_id`` / ``kv_model_name``: the names a worker goes by
"""

from worker.drain import Drain, install_drain
from worker.gateway_links import GatewayLinks
from worker.gateway_socket import WorkerSocket
from worker.heartbeat import HeartbeatTimer
from worker.http_server import HttpHandle, serve_http
from worker.identity import default_worker_id, kv_model_name
from worker.liveness import Liveness, StepWatch
from worker.logs import setup_logging
from worker.metrics import EngineMetrics, EngineSnapshot

__all__ = [
    "Drain",
    "EngineMetrics",
    "EngineSnapshot",
    "GatewayLinks",
    "default_worker_id",
    "kv_model_name",
    "HeartbeatTimer",
    "HttpHandle",
    "Liveness",
    "StepWatch",
    "WorkerSocket",
    "install_drain",
    "serve_http",
    "setup_logging",
]
