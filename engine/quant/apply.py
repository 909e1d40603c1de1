"""Putting quantized weights into a model: ``linear_for``, the one entry point a loader calls with a weight
record, and ``quantize_projections`` for ``--quantization int8`` (made at load from the float weights).

A weight whose format has no kernel here, or a machine where the C kernels do not build, gets a float
``Linear`` of the dequantized weight instead, and the log says so once per format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gguf
import numpy as np
import torch
from torch import nn

from configs.schema import ConfigError
from engine.model.cpu_linear import Linear
from engine.quant.int8 import dequantize_int8, quantize_int8
from engine.quant.linear import QuantLinear
from engine.quant.weight import QuantizedWeight, concat_rows
from kernels.cpu import half as cpu_half
from kernels.cpu import quant as cpu_quant
from kernels.cpu.row_library import RowKernelLibrary

log = logging.getLogger(__name__)

# --quantization values for float checkpoints (GGUF files bring their own formats), and their quantizers
METHODS: dict[str, Callable[[torch.Tensor], QuantizedWeight]] = {"int8": quantize_int8}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 [out, in] weight the record stands for (kernels/cpu/quant.c's decoding)."""
    if weight.type_name == "I8":
        return dequantize_int8(weight)
    lib = library_for(weight.type_name)
    if lib is not None:
        return lib.dequantize(weight.type_name, weight.rows, weight.in_features)
    values = gguf.dequantize(weight.rows.numpy(), gguf.GGMLQuantizationType[weight.type_name])  # no compiler
    return torch.from_numpy(values.astype(np.float32))


def library_for(type_name: str) -> RowKernelLibrary | None:
    """The C kernels that run ``type_name`` (None where they do not build here): kernels/cpu/half.c's for
    F16/BF16 rows, kernels/cpu/quant.c's for the block formats and I8."""
    return cpu_half.load() if type_name in cpu_half.TYPE_IDS else cpu_quant.load()


def linear_for(weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The module computing ``x @ weight^T + bias``: a ``QuantLinear`` for a quantized record where the
    kernels load, else a float ``Linear`` (of the dequantized record)."""
    lib = library_for(weight.type_name) if isinstance(weight, QuantizedWeight) else None
    if lib is not None:
        return QuantLinear(weight, bias, lib)
    if isinstance(weight, QuantizedWeight):
        log.warning("no quantized C kernels here: %s weights dequantized to float32", weight.type_name)
        weight = dequantize(weight)
    out_features, in_features = weight.shape
    module = Linear(in_features, out_features, bias=bias is not None, device="meta").requires_grad_(False)
    module.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias.float().contiguous(), requires_grad=False)
    return module


def set_projection(layer: nn.Module, path: str, module: nn.Module) -> None:
    """Replaces ``layer``'s submodule at ``path`` ("mlp.down_proj"), keeping its LoRA hook."""
    parent_name, _, name = path.rpartition(".")
    parent = layer.get_submodule(parent_name)
    old = getattr(parent, name)
    module.lora_key, module.lora_ref = getattr(old, "lora_key", None), getattr(old, "lora_ref", None)
    setattr(parent, name, module)


def quantize_projections(model: nn.Module, quantizer: Callable[[torch.Tensor], QuantizedWeight]) -> int:
    """Every decoder layer's four projections replaced by ``quantizer(weight)``, as vLLM's ``--quantization``
    does: the embedding and LM head stay float. Returns the bytes the quantized weights take."""
    total = 0
    for layer in model.layers:
        for path in PROJECTIONS:
            old = layer.get_submodule(path)
            record = quantizer(old.weight)
            total += record.nbytes
            set_projection(layer, path, linear_for(record, old.bias))
    return total


def quantized_modules(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def use_quant_activations(model: nn.Module, activations: str) -> int:
    """``model.quant_activations``: the block-format projections' kernel calls round x to ``activations``
    (kernels/cpu/quant.py's ``ACTIVATIONS``); returns how many projections that is."""
    lib = cpu_quant.load(activations=activations)
    modules = [m for m in quantized_modules(model) if isinstance(m.lib, cpu_quant.QuantLibrary)]
    for m in modules:
        m.lib = lib
    return len(modules)


def quantize_at_load(model: nn.Module, method: str, device: str) -> None:
    """``--quantization`` applied to a loaded float model (CPU float32 only: the kernels are CPU ones)."""
    dtype = model.embed_tokens.dtype
    if device != "cpu" or dtype != torch.float32:
        raise ConfigError(f"--quantization {method} runs on CPU with float32 weights; this engine is {device} {dtype}")
    if method not in METHODS:
        raise ConfigError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    before = sum(m.weight.numel() * 4 for layer in model.layers for m in map(layer.get_submodule, PROJECTIONS))
    after = quantize_projections(model, METHODS[method])
    log.info("quantization %s: the layers' projections %.0f MiB -> %.0f MiB", method, before / 2**20, after / 2**20)


def fused_weight(parts: list[QuantizedWeight | torch.Tensor], keep: bool) -> QuantizedWeight | torch.Tensor:
    """One weight from a fused projection's parts (rows in order): the quantized record where ``keep`` (CPU,
    float32) and every part is one quantized format and width, else float32 (a llama.cpp mix such as
    Q4_K_M's q/k in one format and v in another is dequantized, and the log says so)."""
    if keep and all(isinstance(p, QuantizedWeight) for p in parts):
        if len({(p.type_name, p.in_features) for p in parts}) == 1:
            return parts[0] if len(parts) == 1 else concat_rows(parts)
        log.warning("a fused projection mixes %s: dequantized to float32", "/".join(p.type_name for p in parts))
    floats = [dequantize(p) if isinstance(p, QuantizedWeight) else p.float() for p in parts]
    return floats[0] if len(floats) == 1 else torch.cat(floats, dim=0)


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Puts ``new`` where ``old`` sits under ``root``."""
    for name, module in root.named_modules():
        if module is old:
            parent_name, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent_name), attr, new)
            return
    raise KeyError("module not under root")
