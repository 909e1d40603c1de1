"""A worker's side of the cluster's LoRA adapter list (protocol LoRAAdapterSet): apply a list newer
than the one held (load what is new or moved, drop what it does not name), and report the list held,
its stamp and what failed to load in every heartbeat.

There is one list for the whole cluster, however many gateways front it: each gateway stamps its
change above the newest it has seen, every worker keeps the newest stamp it was sent, and every
gateway serves the newest list any worker reports (gateway/workers/zmq_backend.py). So an adapter
loaded through one gateway is served and listed by all of them, unloading it through any one drops it
everywhere, and a worker or gateway that starts later catches up from the others. A list older than
the one held (a slow gateway's, or one sent before a change it crossed) is ignored; the next
heartbeat tells its sender the newer one.

A dropped adapter is refused for new requests at once; requests already running under it finish
with the weights they started with (engine/lora/manager.py pins them).
"""

from __future__ import annotations

import logging

from engine.lora.adapter import LoRAError
from engine.lora.manager import LoRAManager
from protocol.serving import LoRAAdapterSet

log = logging.getLogger(__name__)


class LoRASync:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager  # None: this worker runs without --enable-lora
        known = dict(manager.known) if manager is not None else {}
        self.held = LoRAAdapterSet(0, list(known), list(known.values()))  # the worker's config: stamp (0, "")
        self.errors: list[str] = []  # "name: why" for the adapters of the list held that did not load

    def apply(self, wanted: LoRAAdapterSet) -> bool:
        """Make ``wanted`` the list served if it is newer than the one held; False when it is not."""
        if wanted.stamp <= self.held.stamp:
            return False
        self.held = wanted
        paths = wanted.as_dict()
        if self.manager is None:
            self.errors = [f"{name}: this worker serves no LoRA adapters (--enable-lora)" for name in paths]
            return True
        errors = []
        for name in [n for n in self.manager.known if n not in paths]:
            self.manager.remove(name)
            log.info("LoRA adapter %s unloaded", name)
        for name, path in paths.items():
            if self.manager.known.get(name) == path:
                continue
            try:
                self.manager.add(name, path)
                log.info("LoRA adapter %s loaded from %s", name, path)
            except LoRAError as exc:
                log.warning("%s", exc)
                errors.append(f"{name}: {exc}")
        self.errors = errors
        return True

    def heartbeat_fields(self) -> dict:
        """The Heartbeat fields that report this worker's adapters."""
        fields = {
            "lora_set_version": self.held.version,
            "lora_set_gateway": self.held.gateway_id,
            "lora_set_names": list(self.held.names),
            "lora_set_paths": list(self.held.paths),
            "lora_set_signature": self.held.signature,  # a worker carries the gateway's list; it cannot make one
            "lora_errors": list(self.errors),
        }
        if self.manager is not None:
            fields |= {"lora_names": sorted(self.manager.known), "hot_lora_names": self.manager.slot_names}
        return fields
