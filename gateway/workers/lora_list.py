"""The cluster's LoRA adapter list as one gateway knows it: the newest stamped list (protocol
LoRAAdapterSet) it made or saw in any worker's heartbeat, and which workers still need it.

The workers are the shared source: each holds the newest list it was sent (engine/lora/sync.py) and
reports it in the heartbeats every gateway receives. A gateway adopts any list newer than its own, so
an adapter loaded or unloaded through one gateway shows in every gateway's ``/v1/models`` within a
heartbeat, and a gateway that starts later learns the list from the first worker it hears. A worker
behind (one that joined later or restarted: it holds its config's list, stamp (0, "")) is sent the
newest list, by whichever gateway hears it first.
"""

from __future__ import annotations

import time

from protocol.serving import Heartbeat, LoRAAdapterSet

RESEND_AFTER_S = 2.0  # a list sent to a worker that still reports an older one is sent again after this


class ClusterLoRAList:
    def __init__(self, config_modules: dict[str, str]) -> None:
        # stamp (0, ""): the list in the workers' own config, which is this gateway's too (pdserve serve)
        self._adopt(LoRAAdapterSet(0, list(config_modules), list(config_modules.values())))
        self._sent: dict[tuple[str, str], tuple[tuple[int, str], float]] = {}  # (worker, incarnation) -> stamp, when

    def paths(self) -> dict[str, str]:
        """The newest list, name -> path (read it, do not change it: every request reads it)."""
        return self._paths

    def _adopt(self, newest: LoRAAdapterSet) -> None:
        self.newest = newest
        self._paths = newest.as_dict()

    def make(self, paths: dict[str, str], gateway_id: str) -> LoRAAdapterSet:
        """A change made here: ``paths`` stamped above every list seen, and now the newest."""
        self._adopt(LoRAAdapterSet(self.newest.version + 1, list(paths), list(paths.values()), gateway_id))
        return self.newest

    def observe(self, hb: Heartbeat) -> bool:
        """Adopt the worker's list if newer; True when the worker is behind and should be sent ours."""
        held = (hb.lora_set_version, hb.lora_set_gateway)
        if held > self.newest.stamp:
            self._adopt(LoRAAdapterSet(hb.lora_set_version, hb.lora_set_names, hb.lora_set_paths, hb.lora_set_gateway))
        return held < self.newest.stamp

    def due(self, worker_id: str, incarnation: str) -> bool:
        """The newest list should go to this worker now (not already on its way); records the send."""
        key, now = (worker_id, incarnation), time.monotonic()
        sent = self._sent.get(key)
        if sent is not None and sent[0] == self.newest.stamp and now - sent[1] < RESEND_AFTER_S:
            return False
        self._sent[key] = (self.newest.stamp, now)
        return True

    def forget(self, worker_id: str) -> None:
        for key in [k for k in self._sent if k[0] == worker_id]:
            del self._sent[key]


def stamp_of(hb: Heartbeat) -> tuple[int, str]:
    return (hb.lora_set_version, hb.lora_set_gateway)
