"""A PEFT LoRA adapter directory, read and checked against the base model it is meant for.

A directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``)
and ``adapter_model.safetensors`` with, per targeted projection of layer i,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

Our model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (engine/model/layers.py), so an
adapter is stored per *fused* module: the targeted projections' A matrices stacked, and a block-diagonal
B that writes each projection's delta into its own slice of the fused output (scale folded in):

    A: [sum of r over targeted parts, in]
    B: [fused out, sum of r]   rows of q <- B_q (cols 0..r), rows of v <- B_v (cols r..2r), ...; 0 elsewhere

so ``y += (x @ A^T) @ B^T`` adds exactly ``scale * B_p (A_p x)`` to each part p's rows.

An adapter's ``digest`` is a hash of its two files' bytes: its identity beyond name and directory,
so a directory rewritten in place is told apart from what was loaded from it (block hashes carry it,
engine/kv/block_manager.py; a re-read that finds other bytes is refused, engine/lora/manager.py).

Every mismatch with the base (a module it has not, a shape, a rank above ``max_lora_rank``, a PEFT
feature we do not run) is a LoRAError naming the adapter and the mismatch: an adapter that does not fit
must never load and give silently degraded output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import HFModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# projection -> (our fused module, its index among the fused parts)
PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}  # fmt: skip
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot serve this base model; the message names the adapter and the mismatch."""


@dataclass(slots=True)
class LoRAModule:
    """One fused module's delta: ``y += (x @ a^T) @ b^T``."""

    a: torch.Tensor  # [rank sum, in]
    b: torch.Tensor  # [fused out, rank sum], scale folded in

    def to(self, device) -> LoRAModule:
        return LoRAModule(self.a.to(device), self.b.to(device))


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: frozenset[str]  # PEFT projection names, e.g. {"q_proj", "v_proj"}
    modules: dict[tuple[int, str], LoRAModule]  # (layer index, fused module name) -> its delta
    digest: str = ""  # sha256 of the config and weights files as read (files_digest)

    @property
    def key(self) -> tuple[str, str]:
        """Tells apart two loads of the same name whose files differ."""
        return (self.name, self.digest)

    def to(self, device) -> LoRAAdapter:
        moved = {key: module.to(device) for key, module in self.modules.items()}
        return LoRAAdapter(self.name, self.path, self.rank, self.scale, self.targets, moved, self.digest)


def files_digest(path: str | Path) -> str:
    """sha256 over the adapter's config and weights files (what load_adapter reads); "" if unreadable."""
    h = hashlib.sha256()
    try:
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            h.update((Path(path) / file).read_bytes())
            h.update(b"\0")
    except OSError:
        return ""
    return h.hexdigest()


def files_stat(path: str | Path) -> tuple:
    """(size, mtime_ns, inode) of both files: unchanged means not rewritten (a cheap check before hashing)."""
    try:
        stats = [os.stat(Path(path) / file) for file in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return ()
    return tuple((st.st_size, st.st_mtime_ns, st.st_ino) for st in stats)


def part_sizes(config: HFModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Fused module -> (out, in) of each of its parts, in fused order (engine/model/layers.py)."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv_proj": [(q, h), (kv, h), (kv, h)],
        "o_proj": [(h, q)],
        "gate_up_proj": [(inter, h), (inter, h)],
        "down_proj": [(h, inter)],
    }


def load_adapter(
    name: str, path: str | Path, config: HFModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the adapter at ``path``; raises LoRAError."""
    path = Path(path)
    before, digest = files_stat(path), files_digest(path)
    settings = _read_config(name, path)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}")
    _refuse_unsupported(name, settings)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pairs = _read_pairs(name, path, config.num_layers)
    targets = frozenset(proj for _, proj in pairs)
    sizes = part_sizes(config)
    modules: dict[tuple[int, str], LoRAModule] = {}
    for layer in range(config.num_layers):
        by_fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for proj in sorted(targets):
            if (layer, proj) not in pairs:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} has no {proj} weights, other layers do")
            a, b = pairs[layer, proj]
            fused, part = PROJECTIONS[proj]
            out, inp = sizes[fused][part]
            if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
                raise LoRAError(
                    f"LoRA adapter {name!r}: layer {layer} {proj} has lora_A {list(a.shape)} and lora_B "
                    f"{list(b.shape)}; this base model expects [{rank}, {inp}] and [{out}, {rank}]"
                )
            by_fused.setdefault(fused, []).append((part, a, b))
        for fused, parts in by_fused.items():
            modules[layer, fused] = _fuse(sizes[fused], parts, scale, dtype)
    if files_stat(path) != before:  # rewritten while being read: the digest may not be of these weights
        raise LoRAError(f"LoRA adapter {name!r}: its files in {path} changed while being read; load it again")
    return LoRAAdapter(name, str(path), rank, scale, targets, modules, digest)


def _read_config(name: str, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        settings = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    return settings


def _refuse_unsupported(name: str, settings: dict) -> None:
    """PEFT features that change the product: refused rather than served wrong."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {settings['peft_type']!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out"):
        if settings.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {key} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if settings.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {key} is not supported")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias {settings['bias']!r} is not supported (only 'none')")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoRAError(f"LoRA adapter {name!r} targets {unknown}; this base model has {sorted(PROJECTIONS)}")


def _read_pairs(name: str, path: Path, num_layers: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                match = _KEY.match(key)
                if match is None or match[3] not in PROJECTIONS:
                    raise LoRAError(
                        f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a "
                        f"projection this base model has ({', '.join(PROJECTIONS)})"
                    )
                layer = int(match[1])
                if layer >= num_layers:
                    raise LoRAError(
                        f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; "
                        f"the base model has {num_layers} layers"
                    )
                halves[layer, match[3], match[4]] = handle.get_tensor(key)
    except (OSError, ValueError, RuntimeError) as exc:
        if isinstance(exc, LoRAError):
            raise
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file ({exc})") from None
    if not halves:
        raise LoRAError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    pairs = {}
    for layer, proj, half in halves:
        other = "B" if half == "A" else "A"
        if (layer, proj, other) not in halves:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_{half} but no lora_{other}")
        pairs[layer, proj] = (halves[layer, proj, "A"], halves[layer, proj, "B"])
    return pairs


def _fuse(parts_out_in: list[tuple[int, int]], parts, scale: float, dtype: torch.dtype) -> LoRAModule:
    """Stack the targeted parts' A; place each part's scaled B on its rows and its own rank columns."""
    offsets = [0]
    for out, _ in parts_out_in:
        offsets.append(offsets[-1] + out)
    rank_sum = sum(a.shape[0] for _, a, _ in parts)
    b_fused = torch.zeros(offsets[-1], rank_sum, dtype=torch.float32)
    column = 0
    for part, a, b in parts:
        r = a.shape[0]
        b_fused[offsets[part] : offsets[part + 1], column : column + r] = b.float() * scale
        column += r
    a_fused = torch.cat([a.float() for _, a, _ in parts], dim=0)
    return LoRAModule(a_fused.to(dtype).contiguous(), b_fused.to(dtype).contiguous())
