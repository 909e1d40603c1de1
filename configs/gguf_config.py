"""A GGUF file's metadata read as the ``config.json`` of the checkpoint it holds (torch-free).

llama.cpp writes no ``config.json``: the model's shape is metadata under its own key names
(``<arch>.block_count``, ``<arch>.attention.head_count_kv``, ...). This module reads those with the
``gguf`` package (the reader llama.cpp publishes) and writes the Hugging Face names the engine's
``HFModelConfig`` and the gateway already read, as transformers' GGUF loader does. Mistral files say
``general.architecture = llama`` (llama.cpp's converter runs Mistral as Llama); like transformers, the
name tells them apart. Anything this cannot describe faithfully is a ``GGUFError`` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# GGUF general.architecture -> the architectures entry of config.json (configs/model_source.py's table)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_ROPE_SCALING = {"none": None, "linear": "linear"}  # llama.cpp's rope.scaling.type -> HF rope_type


class GGUFError(ValueError):
    """The file is not a GGUF this server runs; the message is one line, without the file's name."""


@dataclass(slots=True, frozen=True)
class GGUFHeader:
    """What the file says about itself: metadata values and the tensors' names, types and shapes."""

    metadata: dict  # key -> value (strings, numbers, lists), as GGUFReader's field.contents() gives them
    tensor_types: dict[str, str]  # GGUF tensor name -> ggml type name ("Q4_1", "F32", ...)
    tensor_shapes: dict[str, tuple[int, ...]]  # GGUF tensor name -> shape, outermost first ([out, in])

    def __post_init__(self) -> None:
        assert set(self.tensor_types) == set(self.tensor_shapes)


def read_header(path: Path):
    """(GGUFHeader, the open GGUFReader) for ``path``; GGUFError when it is not a whole GGUF file."""
    from gguf import GGUFReader  # numpy only; imported here so configs/ stays light for the other roles

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise GGUFError(f"not a readable GGUF file: truncated or corrupt ({_first_line(exc)})") from None
    metadata = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"metadata {key!r} cannot be read ({_first_line(exc)})") from None
    return GGUFHeader(
        metadata=metadata,
        tensor_types={t.name: t.tensor_type.name for t in reader.tensors},
        tensor_shapes={t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors},
    ), reader


def hf_config(header: GGUFHeader) -> dict:
    """The ``config.json`` of the checkpoint the file holds, in transformers' names."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"unsupported architecture {arch!r}; pdserve runs GGUF {', '.join(GGUF_ARCHITECTURES)}")
    name = str(meta.get("general.name", "")).lower()
    architecture, model_type = GGUF_ARCHITECTURES["mistral" if arch == "llama" and "mistral" in name else arch]
    if "rope_freqs.weight" in header.tensor_types:
        raise GGUFError("per-frequency RoPE factors (tensor rope_freqs.weight, Llama 3.1 scaling) are not supported")

    def key(suffix: str, default=None):
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None:
            raise GGUFError(f"metadata {arch}.{suffix} is missing")
        return value

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise GGUFError("per-layer head counts are not supported")
    hidden = key("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": len(tokens) if tokens is not None else key("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": key("context_length"),
        "rope_parameters": _rope(meta, arch),
        "hidden_act": "silu",
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in header.tensor_types,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in header.tensor_types,
    }
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config


def _rope(meta: dict, arch: str) -> dict:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if kind not in _ROPE_SCALING:
        raise GGUFError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(_ROPE_SCALING)}")
    if _ROPE_SCALING[kind] is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": _ROPE_SCALING[kind], "rope_theta": theta, "factor": float(meta[f"{arch}.rope.scaling.factor"])}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
