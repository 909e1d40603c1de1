"""A GGUF file's projections kept quantized: each decoder layer's fused q/k/v, o, gate/up and down
projection becomes the quantized kernels' linear (engine/quant/apply.linear_for) over the file's own
rows of blocks, when every part of it is in one format a kernel runs (a Q4_K_M file mixes formats
within a layer: a fused projection whose parts differ stays float). The LM head too, in the file's
format (``output``, or ``token_embd`` when tied), as llama.cpp runs it: in float32 it is the largest
weight a decode step reads (SmolLM2's 49152 x 576 head is 113 MB of a step's 226 MB at Q8_0). The
embedding's rows are gathered from a float32 copy (one row per token: no step reads it whole), and
the norms stay float. CPU float32 only: the kernels are CPU ones.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from engine.model.gguf_tensors import GGUFTensors
from engine.quant.apply import linear_for, set_projection
from engine.quant.weight import QuantizedWeight, concat_rows

log = logging.getLogger(__name__)

# the model's fused projection -> the checkpoint's parts, in row order
PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def keep_quantized(lm: nn.Module, tensors: GGUFTensors) -> tuple[Counter, Counter]:
    """Swaps each projection whose parts are one quantized format for its quantized linear; returns
    (kept projections by format, float projections by their parts' formats) and logs both."""
    kept, floats = Counter(), Counter()
    for i, layer in enumerate(lm.layers):
        for fused, parts in PARTS.items():
            weights = [tensors.weight(f"model.layers.{i}.{part}.weight") for part in parts]
            kinds = {w.type_name if isinstance(w, QuantizedWeight) else "float" for w in weights}
            if len(kinds) != 1 or kinds == {"float"}:
                floats["+".join(sorted(kinds))] += 1
                continue
            record = weights[0] if len(weights) == 1 else concat_rows(weights)
            set_projection(layer, fused, linear_for(record, layer.get_submodule(fused).bias))
            kept[record.type_name] += 1
    head = tensors.weight("model.embed_tokens.weight" if lm.config.tie_word_embeddings else "lm_head.weight")
    if isinstance(head, QuantizedWeight):
        lm.quantized_head = linear_for(head)  # float32 when no kernel builds here (linear_for says so)
        kept[f"{head.type_name} LM head"] += 1
    else:
        floats["float LM head"] += 1
    log.info(
        "GGUF projections kept quantized: %s; run in float32 (dequantized at load): %s",
        ", ".join(f"{k} x{n}" for k, n in kept.most_common()) or "none",
        ", ".join(f"{k} x{n}" for k, n in floats.most_common()) or "none",
    )
    return kept, floats
