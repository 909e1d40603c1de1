"""A worker's side of the gateway's LoRA adapter list (protocol LoRAAdapterSet): load what is new,
drop what is gone, report the version applied and what failed in the next heartbeat.

A dropped adapter is refused for new requests at once; requests already running under it finish from
the copy still resident (engine/lora_manager.py).
"""

from __future__ import annotations

import logging

from engine.lora_adapter import LoRAError
from engine.lora_manager import LoRAManager
from protocol.serving import LoRAAdapterSet

log = logging.getLogger(__name__)


class LoRASync:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager  # None: this worker runs without --enable-lora
        self.version = 0  # the worker's config is version 0 of the gateway's list
        self.errors: list[str] = []  # "name: why" for the adapters of ``version`` that did not load

    def apply(self, wanted: LoRAAdapterSet) -> None:
        errors = []
        paths = dict(zip(wanted.names, wanted.paths))
        if self.manager is None:
            errors = [f"{name}: this worker serves no LoRA adapters (--enable-lora)" for name in paths]
        else:
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
        self.version, self.errors = wanted.version, errors

    def heartbeat_fields(self) -> dict:
        """The Heartbeat fields that report this worker's adapters."""
        fields = {"lora_version": self.version, "lora_errors": list(self.errors)}
        if self.manager is not None:
            fields |= {"lora_names": sorted(self.manager.known), "hot_lora_names": self.manager.slot_names}
        return fields
