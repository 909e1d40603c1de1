"""The adapters a node serves: names it knows, copies in host memory, slots on the device, and the
gathered LoRA product of one step.

Three tiers, as vLLM's ``--lora-modules`` / ``--max-cpu-loras`` / ``--max-loras``:

    known    name -> directory; checked against the base when registered (``add``), so a bad adapter
             is refused at start-up or at ``/v1/load_lora_adapter``, never at a request
    host     up to max_cpu_loras adapters read into host memory, least recently used out (re-read from
             the directory when needed again)
    device   up to max_loras adapters in the device's slots, least recently used out; on CPU host and
             device are the same memory and a slot is a reference, but the table and its LRU are the same

A step needs a slot for each distinct adapter in its batch. When one step needs more than max_loras,
the extra ones are applied from their host copy for that step (moved for it on CUDA): a request is
never refused for want of a slot.

The product (``LoRAStep.add_delta``): the step's rows are grouped by adapter once, and each LoRA-capable
linear adds ``(x[rows] @ A^T) @ B^T`` per group (engine/lora_adapter.py has the fused layout).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.lora_adapter import LoRAAdapter, LoRAError, LoRAModule, load_adapter
from engine.model_config import HFModelConfig
from engine.stacked_lora import StackedLoRA, StackedStep, use_lora_kernel


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
            self.stacked.add_delta(key, x, y)  # (engine/stacked_lora.py, kernels/lora_batched.py)
            return
        for rows, adapter in self.groups:
            module: LoRAModule | None = adapter.modules.get(key)
            if module is None:
                continue
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
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, LoRAAdapter] = OrderedDict()  # device copies, least recently used first
        self.num_host_loads = 0  # directory reads (first load and re-reads after eviction)
        self._stacked = StackedLoRA(config, self.device) if use_lora_kernel(self.device) else None

    @property
    def max_cpu_loras(self) -> int:
        return self.limits.max_cpu_loras or self.limits.max_loras

    def add(self, name: str, path: str) -> None:
        """Register (or replace) adapter ``name``; reads and checks it now. Raises LoRAError."""
        if not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        adapter = load_adapter(name, path, self.config, self.limits.max_lora_rank, self.dtype)
        self._slots.pop(name, None)  # a replaced adapter's old weights are not used again
        self.known[name] = str(path)
        self._keep_on_host(adapter)

    def remove(self, name: str) -> bool:
        """Forget adapter ``name`` (new requests are refused); False when it was not known. Its copies
        stay until least recently used out, so requests already running under it finish."""
        return self.known.pop(name, None) is not None

    def check(self, name: str, path: str = "") -> str:
        """Empty when a request may name ``name`` ("" is the base), else the reason. ``path``: the
        directory the request's gateway knows it by ("" any): it must be the one loaded here."""
        if name and name not in self.known:
            return f"LoRA adapter {name!r} is not loaded on this worker"
        if name and path and self.known[name] != path:
            return f"LoRA adapter {name!r} is loaded from {self.known[name]} on this worker, not {path}"
        return ""

    def step(self, names_per_token: list[str]) -> LoRAStep:
        """The step's groups, from each token row's adapter name ("" = base)."""
        rows_by_name: dict[str, list[int]] = {}
        for row, name in enumerate(names_per_token):
            if name:
                rows_by_name.setdefault(name, []).append(row)
        groups = []
        for name, rows in rows_by_name.items():
            adapter = self._on_device(name, set(rows_by_name))
            every_row = len(rows) == len(names_per_token)
            groups.append((None if every_row else torch.tensor(rows, device=self.device), adapter))
        stacked = self._stacked.step(groups, len(names_per_token)) if self._stacked and groups else None
        return LoRAStep(groups, stacked)

    def _on_device(self, name: str, in_step: set[str]) -> LoRAAdapter:
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        host = self._on_host(name)
        device_copy = host if self.device.type == "cpu" else host.to(self.device)
        evictable = [n for n in self._slots if n not in in_step]
        if len(self._slots) < self.limits.max_loras or evictable:
            if len(self._slots) >= self.limits.max_loras:
                del self._slots[evictable[0]]
            self._slots[name] = device_copy
        return device_copy  # no slot free of this step's adapters: used for this step only

    def _on_host(self, name: str) -> LoRAAdapter:
        if name in self._host:  # known, or removed while requests still run under it
            self._host.move_to_end(name)
            return self._host[name]
        if name not in self.known:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded on this worker")
        adapter = load_adapter(name, self.known[name], self.config, self.limits.max_lora_rank, self.dtype)
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
