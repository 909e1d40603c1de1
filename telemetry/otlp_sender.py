"""What the exporter asks of a protocol: send one encoded batch, or raise ``ExportFailed``.

Its own module so the exporter and each protocol's sender import it, and not each other.
"""

from __future__ import annotations

from typing import Protocol


class ExportFailed(Exception):
    """A batch the collector did not take: unreachable, refused, or too slow."""


class Sender(Protocol):
    target: str  # where the batches go, for log lines

    def send(self, body: bytes, timeout_s: float) -> None:
        """Deliver one encoded ExportTraceServiceRequest; raise ExportFailed if it was not taken."""

    def close(self) -> None: ...
