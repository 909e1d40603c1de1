"""A worker's side of the gateways' LoRA adapter lists (protocol LoRAAdapterSet): load what is new,
drop what no list names, report each gateway's version applied and what failed in the next heartbeat.

With several gateways in front of the pools, each sends its own list (adapters loaded through it at
run time); the worker serves their union with its own config's, so no gateway's list undoes another's
(an adapter of the config unloaded at a gateway stays loaded here: that gateway 404s it). A dropped adapter is
refused for new requests at once; requests already running under it finish from the copy still
resident (engine/lora_manager.py).
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
        self.lists: dict[str, LoRAAdapterSet] = {}  # gateway id -> the list it sent last
        self.config_paths = dict(manager.known) if manager is not None else {}  # the worker's own (version 0)
        self.errors: list[str] = []  # "name: why" for the adapters of the last lists that did not load

    def apply(self, wanted: LoRAAdapterSet) -> None:
        self.lists[wanted.gateway_id] = wanted
        # The config's adapters stay (a gateway that never sent a list serves them); a list's path wins.
        paths = dict(self.config_paths)
        for listed in self.lists.values():
            paths |= dict(zip(listed.names, listed.paths))
        if self.manager is None:
            self.errors = [f"{name}: this worker serves no LoRA adapters (--enable-lora)" for name in paths]
            return
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

    def heartbeat_fields(self) -> dict:
        """The Heartbeat fields that report this worker's adapters."""
        fields = {
            "lora_versions": [f"{gid}:{listed.version}" for gid, listed in self.lists.items()],
            "lora_errors": list(self.errors),
        }
        if self.manager is not None:
            fields |= {"lora_names": sorted(self.manager.known), "hot_lora_names": self.manager.slot_names}
        return fields
