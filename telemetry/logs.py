"""One log format for every process: the gateway and both worker kinds.

text: ``time LEVEL role[worker_id] logger: message``; messages carry ``rid=...`` for a request.
json: one object per line, ``{"time", "level", "role", "worker_id", "request_id", "logger", "message"}``
(plus ``exception`` when there is one), what log pipelines (Loki, Elasticsearch, Cloud Logging) parse
without a pattern. ``request_id`` is the record's ``extra={"request_id": ...}`` or the message's
``rid=...``; null when neither names one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime

_RID = re.compile(r"\brid=([^\s,;)]+)")


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str, worker_id: str):
        super().__init__()
        self.role, self.worker_id = role, worker_id

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        request_id = getattr(record, "request_id", None)
        if request_id is None and (match := _RID.search(message)):
            request_id = match.group(1)
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "role": self.role,
            "worker_id": self.worker_id,
            "request_id": request_id,
            "logger": record.name,
            "message": message,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def text_formatter(role: str, worker_id: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s %(levelname)s {role}[{worker_id}] %(name)s: %(message)s")


def setup_logging(role: str, worker_id: str, level: str | int = "INFO", log_format: str = "text") -> None:
    """Route every logger of this process to stderr in ``log_format`` (configs: observability)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role, worker_id) if log_format == "json" else text_formatter(role, worker_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
