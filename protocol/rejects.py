"""Frames refused from peers: counted by reason, logged once per peer.

Every process that reads a socket keeps one ``RejectLog``. A hostile or broken peer can send millions
of bad frames: each is counted (the process wires ``count`` to its ``pdserve:rejected_frames_total``
Prometheus counter, label ``reason``), but only the first from each peer is logged, so the log cannot
be flooded. Reasons are a small fixed vocabulary (metric label values), the detail goes to the log.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

REASONS = (
    "malformed",  # not a valid record of an expected type (codec, frame count, size)
    "invalid_value",  # a valid record whose values this process cannot use (address, block id, token id...)
    "bad_proof",  # a registration whose membership proof does not verify
    "identity_taken",  # a worker id bound to another key, whose owner is alive
    "unregistered",  # a record from a peer that never registered
    "not_assigned",  # a record for a request this peer was not given
    "handler_error",  # handling the record raised: a bug, caught at the per-message boundary
)
MAX_PEERS_REMEMBERED = 4096


class RejectLog:
    def __init__(self, logger: logging.Logger, count: Callable[[str], None] = lambda reason: None):
        self._log = logger
        self._count = count
        self._logged: collections.OrderedDict[str, None] = collections.OrderedDict()  # peers logged already
        self.counts: collections.Counter[str] = collections.Counter()

    def reject(self, reason: str, peer: str, detail: str, *, exc_info: bool = False) -> None:
        assert reason in REASONS, reason
        self.counts[reason] += 1
        self._count(reason)
        key = f"{reason}:{peer}"
        if key in self._logged:
            return
        self._logged[key] = None
        while len(self._logged) > MAX_PEERS_REMEMBERED:
            self._logged.popitem(last=False)
        self._log.warning(
            "rejected a frame from %s (%s): %s; more like it from this peer are only counted",
            peer[:80] or "a peer",
            reason,
            detail[:300],
            exc_info=exc_info,
        )
