"""One log format for every worker: time, level, role and worker id, then ``rid=... what happened``."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, worker_id: str, level: str | int = "INFO") -> None:
    fmt = f"%(asctime)s %(levelname)s {role}[{worker_id}] %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
