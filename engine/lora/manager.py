"""The adapters a node serves: names it knows, copies in host memory, slots on the device, and the
gathered LoRA product of one step.

Three tiers, as vLLM's ``--lora-modules`` / ``--max-cpu-loras`` / ``--max-loras``:

    known    name -> directory; checked against the base when registered (``add``), so a bad adapter
             is refused at start-up or at ``/v1/load_lora_adapter``, never at a request
    host     up to max_cpu_loras adapters read into host memory, least recently used out (re-read from
             the directory when needed again)
    device   up to max_loras adapters in the device's slots, least recently used out; on CPU host and
             device are the same memory and a slot is a reference, but the table and its LRU are the same

A request pins the adapter it was admitted under (``pin``: its SamplingParams hold that copy), so it
runs to its end with those weights even when the adapter is unloaded, LRU-evicted from host memory,
or its directory rewritten meanwhile; the copy is freed once no request and no tier holds it. Each
load records the files' digest: a re-read after eviction that finds other bytes is refused (load it
again to serve the new ones), and a load of rewritten files is a new identity in the block hashes,
so no KV computed under the old weights is reused.

A step needs a slot for each distinct adapter in its batch. When one step needs more than max_loras,
the extra ones are applied from their host copy for that step (moved for it on CUDA): a request is
never refused for want of a slot.

The product (``LoRAStep.add_delta``): the step's rows are grouped by adapter once, and each LoRA-capable
linear adds ``(x[rows] @ A^T) @ B^T`` per group (engine/lora/adapter.py has the fused layout), in
``add_lora_delta``: the dispatch point of a device kernel (the CUDA one lives in kernels/).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.lora.adapter import LoRAAdapter, LoRAError, LoRAModule, files_stat, load_adapter
from engine.lora.stacked import StackedLoRA, StackedStep, use_lora_kernel
from engine.model.config import HFModelConfig


@dataclass(slots=True, frozen=True)
class LoRALimits:
    max_loras: int = 1  # adapters in device slots at once
    max_lora_rank: int = 16  # highest rank accepted
    max_cpu_loras: int | None = None  # adapters in host memory; None: max_loras

    def __post_init__(self) -> None:
        assert self.max_loras >= 1 and self.max_lora_rank >= 1, self
        assert self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, self


@dataclass(slots=True)
class LoRAStep:
    """One step's adapters: (token rows or None for all, adapter) per group; empty = base only."""

    groups: list[tuple[torch.Tensor | None, LoRAAdapter]] = field(default_factory=list)
    stacked: StackedStep | None = None  # CUDA with Triton: the same groups as the kernel's inputs

    def add_delta(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ A^T) @ B^T`` for each group's adapter that targets module ``key``."""
        if self.stacked is not None:  # the one dispatch point: every group in one Triton launch pair
            self.stacked.add_delta(key, x, y)  # (engine/lora/stacked.py, kernels/triton/lora_batched.py)
            return
        targeted = [(rows, module) for rows, adapter in self.groups if (module := adapter.modules.get(key)) is not None]
        if targeted:
            add_lora_delta(x, y, targeted)


def add_lora_delta(x: torch.Tensor, y: torch.Tensor, groups: list[tuple[torch.Tensor | None, LoRAModule]]) -> None:
    """The batched LoRA product of one projection, in place: ``y[rows] += (x[rows] @ A^T) @ B^T`` for
    each (rows, module) group (rows None: every row). x: [tokens, in], y: [tokens, fused out]; groups'
    rows are disjoint. The torch reference, and the one place a device kernel takes over."""
    for rows, module in groups:
        if rows is None:
            y.add_((x @ module.a.T) @ module.b.T)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ module.a.T) @ module.b.T)


NO_LORA = LoRAStep()


@dataclass(slots=True)
class LoRAStepRef:
    """Shared by the model's projections: the step now running (set by CausalLM.forward)."""

    step: LoRAStep = field(default_factory=lambda: NO_LORA)


class LoRAManager:
    def __init__(self, config: HFModelConfig, limits: LoRALimits, dtype: torch.dtype, device: torch.device | str):
        self.config = config
        self.limits = limits
        self.dtype = dtype
        self.device = torch.device(device)
        self.known: dict[str, str] = {}  # name -> directory
        self._loaded: dict[str, tuple[str, tuple]] = {}  # name -> (digest, files_stat) of its files when added
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, LoRAAdapter] = OrderedDict()  # device copies, least recently used first
        self.num_host_loads = 0  # directory reads (first load and re-reads after eviction)
        self._stacked = StackedLoRA(config, self.device) if use_lora_kernel(self.device) else None

    @property
    def max_cpu_loras(self) -> int:
        return self.limits.max_cpu_loras or self.limits.max_loras

    def add(self, name: str, path: str) -> bool:
        """Register (or replace) adapter ``name``; reads and checks it now. Raises LoRAError. False (and
        nothing read) when ``name`` is loaded from ``path`` already and its files are as they were."""
        if not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        if self.known.get(name) == str(path) and self._loaded[name][1] == files_stat(path) != ():
            return False
        adapter = load_adapter(name, path, self.config, self.limits.max_lora_rank, self.dtype)
        self._slots.pop(name, None)  # a replaced adapter's old weights are not used again
        self.known[name] = str(path)
        self._loaded[name] = (adapter.digest, files_stat(path))
        self._keep_on_host(adapter)
        return True

    def remove(self, name: str) -> bool:
        """Forget adapter ``name`` (new requests are refused); False when it was not known. Requests
        already running under it finish with the copy they pinned."""
        self._loaded.pop(name, None)
        self._host.pop(name, None)  # running requests hold their pinned copy; nothing else needs it
        self._slots.pop(name, None)
        return self.known.pop(name, None) is not None

    def check(self, name: str, path: str = "") -> str:
        """Empty when a request may name ``name`` ("" is the base), else the reason. ``path``: the
        directory the request's gateway knows it by ("" any): it must be the one loaded here."""
        if name and name not in self.known:
            return f"LoRA adapter {name!r} is not loaded on this worker"
        if name and path and self.known[name] != path:
            return f"LoRA adapter {name!r} is loaded from {self.known[name]} on this worker, not {path}"
        return ""

    def pin(self, name: str) -> LoRAAdapter:
        """The host copy a new request under ``name`` runs with to its end (it holds the reference).
        Re-read from the directory if evicted; raises LoRAError if not loaded, or if the files there
        are no longer the ones loaded."""
        return self._on_host(name)

    def step(self, adapters_per_token: list[LoRAAdapter | None]) -> LoRAStep:
        """The step's groups, from each token row's pinned adapter (None = base)."""
        rows_by_key: dict[tuple[str, str], list[int]] = {}
        pinned: dict[tuple[str, str], LoRAAdapter] = {}
        for row, adapter in enumerate(adapters_per_token):
            if adapter is not None:
                rows_by_key.setdefault(adapter.key, []).append(row)
                pinned[adapter.key] = adapter
        groups = []
        for key, rows in rows_by_key.items():
            adapter = self._on_device(pinned[key], set(rows_by_key))
            every_row = len(rows) == len(adapters_per_token)
            groups.append((None if every_row else torch.tensor(rows, device=self.device), adapter))
        stacked = self._stacked.step(groups, len(adapters_per_token)) if self._stacked and groups else None
        return LoRAStep(groups, stacked)

    def _on_device(self, host: LoRAAdapter, in_step: set[tuple[str, str]]) -> LoRAAdapter:
        if (slot := self._slots.get(host.name)) is not None and slot.key == host.key:
            self._slots.move_to_end(host.name)
            return slot
        device_copy = host if self.device.type == "cpu" else host.to(self.device)
        if host.name in self._slots and self._slots[host.name].key in in_step:
            return device_copy  # the slot holds another load of this name that this step runs too
        self._slots.pop(host.name, None)  # an older load of this name: its requests have the host copy
        evictable = [n for n, a in self._slots.items() if a.key not in in_step]
        if len(self._slots) < self.limits.max_loras or evictable:
            if len(self._slots) >= self.limits.max_loras:
                del self._slots[evictable[0]]
            self._slots[host.name] = device_copy
        return device_copy  # no slot free of this step's adapters: used for this step only

    def _on_host(self, name: str) -> LoRAAdapter:
        if name not in self.known:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded on this worker")
        if name in self._host:
            self._host.move_to_end(name)
            return self._host[name]
        adapter = load_adapter(name, self.known[name], self.config, self.limits.max_lora_rank, self.dtype)
        if adapter.digest != self._loaded[name][0]:  # rewritten in place since it was loaded
            raise LoRAError(
                f"LoRA adapter {name!r}: its files in {self.known[name]} changed since it was loaded; "
                "unload and load it again to serve them"
            )
        self._keep_on_host(adapter)
        return adapter

    def _keep_on_host(self, adapter: LoRAAdapter) -> None:
        self.num_host_loads += 1
        self._host[adapter.name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    @property
    def slot_names(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._slots)

    @property
    def host_names(self) -> list[str]:
        return list(self._host)
