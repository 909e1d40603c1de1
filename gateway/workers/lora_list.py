"""The cluster's LoRA adapter list as one gateway knows it: the newest stamped list (protocol
LoRAAdapterSet) it made or saw in any worker's heartbeat, and which workers still need it.

The workers are the shared source: each holds the newest list it was sent (engine/lora/sync.py) and
reports it in the heartbeats every gateway receives. A gateway adopts any list newer than its own, so
an adapter loaded or unloaded through one gateway shows in every gateway's ``/v1/models`` within a
heartbeat, and a gateway that starts later learns the list from the first worker it hears. A worker
behind (one that joined later or restarted: it holds its config's list, stamp (0, "")) is sent the
newest list, by whichever gateway hears it first.

Only a gateway makes a list: it signs each list it makes with its member key (protocol/curve.py), and a
list reported in a heartbeat is adopted only when a key listed for the gateway role signed it. A worker
carries lists between gateways but cannot stamp one: a forged or unsigned list is ignored (and logged
once per worker), so one compromised worker cannot map tenants' adapter names to its own weights on
every worker. Insecure clusters (``transfer.insecure``: no keys) sign nothing and check nothing.
"""

from __future__ import annotations

import json
import logging
import time

from protocol.curve import ClusterKey
from protocol.serving import Heartbeat, LoRAAdapterSet

log = logging.getLogger("pdserve.gateway")

RESEND_AFTER_S = 2.0  # a list sent to a worker that still reports an older one is sent again after this


class ClusterLoRAList:
    def __init__(self, config_modules: dict[str, str], key: ClusterKey | None = None) -> None:
        self._key = key  # signs the lists made here, checks the ones heard; None: insecure
        self.num_forged = 0  # heartbeat lists newer than ours that no gateway key signed
        self._forgers: set[str] = set()  # workers already logged for one
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
        made = LoRAAdapterSet(self.newest.version + 1, list(paths), list(paths.values()), gateway_id)
        if self._key is not None:
            made.signature = self._key.sign_as("gateway", signed_text(made))
        self._adopt(made)
        return self.newest

    def observe(self, hb: Heartbeat) -> bool:
        """Adopt the worker's list if newer and a gateway signed it; True when the worker is behind and
        should be sent ours."""
        held = (hb.lora_set_version, hb.lora_set_gateway)
        if held > self.newest.stamp:
            heard = LoRAAdapterSet(
                hb.lora_set_version, hb.lora_set_names, hb.lora_set_paths, hb.lora_set_gateway, hb.lora_set_signature
            )
            if self._key is None or self._key.signed_by("gateway", signed_text(heard), heard.signature):
                self._adopt(heard)
            else:
                self.num_forged += 1
                if hb.worker_id not in self._forgers and len(self._forgers) < 1000:
                    self._forgers.add(hb.worker_id)
                    log.warning("worker %s reports a LoRA list no gateway signed: ignored", hb.worker_id[:64])
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


def signed_text(lora_set: LoRAAdapterSet) -> bytes:
    """What a gateway signs: the stamp and the whole list, in one canonical form."""
    body = [lora_set.version, lora_set.gateway_id, lora_set.names, lora_set.paths]
    return b"pdserve lora list v1\0" + json.dumps(body, separators=(",", ":")).encode()
