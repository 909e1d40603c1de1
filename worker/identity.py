"""Names a worker goes by: its id at the gateway and the model name its KV handshakes compare."""

from __future__ import annotations

import os
import socket

DEFAULT_MODEL_NAME = "pdserve-default"  # config model.path "" (the embedded small model)


def default_worker_id(role: str) -> str:
    """``<role>-<hostname>-<pid>``: unique per process on a host; restarts get a new incarnation anyway."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def kv_model_name(model_path: str) -> str:
    """The ``model`` both ends of a KV transfer put in their compatibility record: the configured
    path (or hub id) as written, so prefill and decode workers must be configured alike."""
    return model_path or DEFAULT_MODEL_NAME
