"""The gathered LoRA product on CUDA: a step's adapters stacked by slot into the layout of
kernels/triton/lora_batched.py, so each projection adds every adapter's delta in one shrink and one expand
launch instead of a gather, two matmuls and a scatter per adapter (engine/lora/manager.py's torch path).

An adapter keeps its fused modules as engine/lora/adapter.py stores them: A stacked over its targeted
parts, B block-diagonal with the scale folded in. Those are copied into the kernel's stacks as they are
(scaling 1.0): part p of an adapter is the kernel's slice p, reading the adapter's rank columns where
``_fuse`` put them (``part_columns``), so the zero blocks of B are never read.

Stacking copies weights, so the stacks of an adapter set are kept across steps (decode steps run the
same set again and again) and made per module on first use; the last ``_SETS_KEPT`` sets are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.lora.adapter import PROJECTIONS, LoRAAdapter, part_sizes
from engine.model.config import HFModelConfig
from kernels.triton.lora_batched import LoRABatch, LoRAWeights, lora_delta_triton, plan_lora_batch
from kernels.triton.triton_or_stub import TRITON_INSTALLED

_SETS_KEPT = 2  # e.g. the decode batch's set and the one a prefill chunk beside it adds


def use_lora_kernel(device: torch.device) -> bool:
    """The Triton kernel serves CUDA tensors; elsewhere (CPU, or no Triton) the torch path runs."""
    return device.type == "cuda" and TRITON_INSTALLED


def part_columns(adapter: LoRAAdapter, fused: str) -> dict[int, int]:
    """Part index -> its first column in the adapter's fused A rows / B columns of ``fused``:
    ``_fuse`` stacks the targeted parts in the order of their sorted projection names, ``rank`` each
    (tests/test_lora_stacked.py compares with the torch path on adapters that skip a part: a change
    of that order fails there)."""
    parts = [PROJECTIONS[proj][1] for proj in sorted(adapter.targets) if PROJECTIONS[proj][0] == fused]
    return {part: i * adapter.rank for i, part in enumerate(parts)}


class _AdapterSetStacks:
    """One adapter set's stacks, slot i = adapters[i], made per module on first use."""

    def __init__(self, adapters: tuple[LoRAAdapter, ...], sizes: dict[str, list[tuple[int, int]]]):
        self.adapters = adapters
        self.sizes = sizes
        self.by_key: dict[tuple[int, str], LoRAWeights | None] = {}

    def weights(self, key: tuple[int, str]) -> LoRAWeights | None:
        """None: no adapter of the set targets module ``key``."""
        if key not in self.by_key:
            self.by_key[key] = self._stack(key)
        return self.by_key[key]

    def _stack(self, key: tuple[int, str]) -> LoRAWeights | None:
        modules = [adapter.modules.get(key) for adapter in self.adapters]
        present = [m for m in modules if m is not None]
        if not present:
            return None
        parts = self.sizes[key[1]]
        offsets = [0]
        for out, _ in parts:
            offsets.append(offsets[-1] + out)
        rows, a0 = max(m.a.shape[0] for m in present), present[0].a
        a = a0.new_zeros(len(modules), rows, a0.shape[1])
        b = a0.new_zeros(len(modules), offsets[-1], rows)
        cols, ranks = [[0] * len(parts) for _ in modules], [[0] * len(parts) for _ in modules]
        for slot, (adapter, module) in enumerate(zip(self.adapters, modules)):
            if module is None:
                continue
            a[slot, : module.a.shape[0]] = module.a
            b[slot, :, : module.b.shape[1]] = module.b
            for part, col in part_columns(adapter, key[1]).items():
                cols[slot][part], ranks[slot][part] = col, adapter.rank
        device = a.device
        return LoRAWeights(
            a,
            b,
            torch.tensor(cols, dtype=torch.int32, device=device),
            torch.tensor(ranks, dtype=torch.int32, device=device),
            torch.ones(len(modules), dtype=torch.float32, device=device),  # the scale is folded into B
            tuple(offsets),
            max_rank=max(max(r) for r in ranks),
        )


@dataclass(slots=True)
class StackedStep:
    """One step's kernel inputs: the token grouping (made once) and its adapter set's stacks."""

    batch: LoRABatch
    stacks: _AdapterSetStacks

    def add_delta(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None:
        weights = self.stacks.weights(key)
        if weights is not None:
            lora_delta_triton(x, y, weights, self.batch)


class StackedLoRA:
    """Held by a LoRAManager on CUDA: the stacks of its recent adapter sets."""

    def __init__(self, config: HFModelConfig, device: torch.device):
        self.sizes = part_sizes(config)
        self.device = device
        # adapter identities, sorted -> that set's stacks; least recently used first. An entry holds
        # its adapters, so their ids are not reused while it is kept.
        self._sets: OrderedDict[tuple[int, ...], _AdapterSetStacks] = OrderedDict()

    def step(self, groups: list[tuple[torch.Tensor | None, LoRAAdapter]], num_tokens: int) -> StackedStep:
        """``groups``: LoRAStep's (token rows or None for all, adapter), one per adapter of the step."""
        stacks = self._stacks_of(tuple(adapter for _, adapter in groups))
        slot_of = {id(adapter): slot for slot, adapter in enumerate(stacks.adapters)}
        slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=self.device)  # -1: base model
        for rows, adapter in groups:
            if rows is None:
                slots.fill_(slot_of[id(adapter)])
            else:
                slots[rows] = slot_of[id(adapter)]
        return StackedStep(plan_lora_batch(slots, len(stacks.adapters)), stacks)

    def _stacks_of(self, adapters: tuple[LoRAAdapter, ...]) -> _AdapterSetStacks:
        key = tuple(sorted(id(adapter) for adapter in adapters))
        if key in self._sets:
            self._sets.move_to_end(key)
            return self._sets[key]
        ordered = tuple(sorted(adapters, key=id))
        self._sets[key] = _AdapterSetStacks(ordered, self.sizes)
        while len(self._sets) > _SETS_KEPT:
            self._sets.popitem(last=False)
        return self._sets[key]
