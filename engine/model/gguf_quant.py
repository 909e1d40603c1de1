"""A GGUF file's projections kept quantized: each decoder layer's fused q/k/v, o, gate/up and down
projection becomes the quantized kernels' linear (engine/quant/apply.linear_for) over the file's own
rows of blocks, when every part of it is in a format a kernel runs. A Q4_K_M file mixes formats within a
layer (SmolLM2's: q/k in Q5_0, v in Q8_0 in 14 of 30 layers): on CPU a fused projection whose parts differ
runs each run of same-format parts on its own kernel (engine/quant/parts.py); on CUDA it stays float.
The LM head too, in the file's format (``output``, or ``token_embd`` when tied), as llama.cpp runs it: in
float32 it is the largest weight a decode step reads (SmolLM2's 49152 x 576 head is 113 MB of a step's
226 MB at Q8_0). The embedding's rows are gathered from a float32 copy (one row per token: no step reads it whole), and
the norms stay float. On CPU with float32 weights the C kernels run them (engine/quant/apply.py); on CUDA
the Triton kernel does (engine/quant/cuda_linear.py) for Q8_0/Q4_0/Q4_1, and the other formats keep the
float weight the loader made (dequantized to the model's dtype at load, logged).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from engine.model.gguf_tensors import GGUFTensors
from engine.quant.apply import linear_for, set_projection
from engine.quant.cuda_linear import cuda_linear_for
from engine.quant.parts import MAX_RUNS, QuantParts, format_runs
from engine.quant.weight import QuantizedWeight, concat_rows
from kernels.cpu import quant as cpu_quant
from kernels.cpu.half import TYPE_IDS as HALF_IDS

log = logging.getLogger(__name__)

# the model's fused projection -> the checkpoint's parts, in row order
PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def keep_quantized(
    lm: nn.Module, tensors: GGUFTensors, device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32
) -> tuple[Counter, Counter]:
    """Swaps each projection whose parts are one quantized format for its quantized linear on ``device``;
    returns (kept projections by format, float projections by their parts' formats) and logs both."""
    kept, floats = Counter(), Counter()

    def make(record: QuantizedWeight, bias) -> nn.Module | None:
        if device.type == "cpu":
            return linear_for(record, bias)
        return cuda_linear_for(record, bias, device, dtype)  # None: no kernel, the float weight stays

    for i, layer in enumerate(lm.layers):
        for fused, parts in PARTS.items():
            weights = [tensors.weight(f"model.layers.{i}.{part}.weight") for part in parts]
            kinds = {w.type_name if isinstance(w, QuantizedWeight) else "float" for w in weights}
            if len(kinds) > 1 and device.type == "cpu" and (split := _split(weights, layer.get_submodule(fused).bias)):
                set_projection(layer, fused, split)
                kept["+".join(r.qweight.type_name for r in split.runs) + " (a kernel each)"] += 1
                continue
            if len(kinds) != 1 or kinds == {"float"}:
                floats["+".join(sorted(kinds))] += 1
                continue
            record = weights[0] if len(weights) == 1 else concat_rows(weights)
            module = make(record, layer.get_submodule(fused).bias)
            if module is None:
                floats[f"{record.type_name} (no {device.type} kernel)"] += 1
                continue
            set_projection(layer, fused, module)
            kept[record.type_name] += 1
    head = tensors.weight("model.embed_tokens.weight" if lm.config.tie_word_embeddings else "lm_head.weight")
    module = make(head, None) if isinstance(head, QuantizedWeight) else None
    if module is not None:
        lm.quantized_head = module  # on CPU a float32 Linear when no kernel builds here (linear_for says so)
        kept[f"{head.type_name} LM head"] += 1
    elif isinstance(head, QuantizedWeight):
        floats[f"{head.type_name} LM head (no {device.type} kernel)"] += 1
    else:
        floats["float LM head"] += 1
    log.info(
        "GGUF projections kept quantized on %s: %s; run in %s (dequantized at load): %s",
        device.type,
        ", ".join(f"{k} x{n}" for k, n in kept.most_common()) or "none",
        str(dtype).removeprefix("torch."),
        ", ".join(f"{k} x{n}" for k, n in floats.most_common()) or "none",
    )
    return kept, floats


def _split(weights: list, bias: torch.Tensor | None) -> QuantParts | None:
    """The projection of quantized parts in several formats on a kernel per format run, where it takes them
    (every part quantized, at most MAX_RUNS runs, the kernels built here); else None: it stays float."""
    lib = cpu_quant.load()
    # the fused decode step holds one library: F16/BF16 parts (kernels/cpu/half.c) beside blocks stay float
    if lib is None or not all(isinstance(w, QuantizedWeight) and w.type_name not in HALF_IDS for w in weights):
        return None
    runs = format_runs(weights)
    return QuantParts(runs, bias, lib) if len(runs) <= MAX_RUNS else None
