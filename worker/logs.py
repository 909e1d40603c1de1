"""Workers log as every pdserve process does (telemetry/logs.py): text or JSON lines, ``rid=...``."""

from __future__ import annotations

from telemetry.logs import setup_logging

__all__ = ["setup_logging"]
