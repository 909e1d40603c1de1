"""A GGUF file's tensors under the Hugging Face names the loader asks for (engine/model/loader.py).

llama.cpp renames every tensor (``model.layers.3.self_attn.q_proj.weight`` is ``blk.3.attn_q.weight``)
and, for the ``llama`` architecture (Mistral included), reorders the rows of q and k so its RoPE can
rotate adjacent pairs. ``get`` maps the name back, reads the weight through ``gguf_weights.weight_for``
and undoes that row order exactly as transformers' GGUF loader does, so the model sees the checkpoint
the file was converted from. Qwen2/Qwen3 files keep HF's row order.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from gguf import GGUFReader

from engine.model.gguf_weights import describe, weight_for
from engine.quant.weight import QuantizedWeight, take_rows

log = logging.getLogger(__name__)

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes q/k rows for these (LlamaModel.permute)


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``; KeyError for others."""
    if match := _HF_LAYER.match(hf_name):
        layer, module, kind = match.groups()
        return f"blk.{layer}.{_LAYER[module]}.{kind}"
    module, _, kind = hf_name.rpartition(".")
    return f"{_TOP[module]}.{kind}"


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row index taking llama.cpp's q/k row order back to HF's: ``hf = gguf[index]``.

    Per head, HF keeps the two RoPE halves apart ([x0..x31 | x32..x63]); llama.cpp interleaves them
    (x0, x32, x1, x33, ...). Rows are whole quantized rows, so this works on raw blocks too.
    """
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFTensors:
    """Name -> tensor over one GGUF file, with the loader's ``get(name, shape)``."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        reader = GGUFReader(path)
        self._tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields["general.architecture"].contents()
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch in _PERMUTED_ARCHS else {}
        log.info("GGUF %s: %s", path.name, describe(list(self._tensors.values())))

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
        tensor = self._tensors.get(gguf_name(name))
        if tensor is None:
            raise ValueError(f"GGUF file is missing tensor {gguf_name(name)!r} ({name}, shape {list(shape)})")
        found = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if found != tuple(shape):
            raise ValueError(f"GGUF tensor {tensor.name!r} has shape {list(found)}; this config expects {list(shape)}")
        weight = weight_for(tensor)
        heads = self._heads.get(tensor.name.split(".")[-2])  # blk.3.attn_q.weight -> attn_q
        if heads is None:
            return weight
        index = unpermute_rows(shape[0], heads)
        return take_rows(weight, index) if isinstance(weight, QuantizedWeight) else weight[index]
