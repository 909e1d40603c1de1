"""What the engine needs to know about a Llama-family checkpoint, parsed from its HF ``config.json``.

Supported: Llama 2/3 (incl. ``llama3`` RoPE scaling), Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm).
Anything the runtime would silently get wrong (sliding windows, other activations, other RoPE types)
is refused here, with the value and the limit in the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from configs.model_source import SUPPORTED_ARCHITECTURES  # the one table: the gateway checks it too

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class HFModelConfig:
    """A checkpoint's ``config.json`` as the engine reads it; the ``model:`` section of pdserve's own
    config is ``configs.schema.ModelConfig``."""

    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE; else {"rope_type": "llama3"|"linear", "factor": ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str | None  # the checkpoint's dtype as written in config.json ("bfloat16", ...)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.family in SUPPORTED_ARCHITECTURES.values(), self.family

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> HFModelConfig:
        """Read ``config.json`` (and the EOS ids of ``generation_config.json`` when present)."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        hf = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        extra_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
        return cls.from_hf_dict(hf, extra_eos_token_ids=extra_eos)

    @classmethod
    def from_hf_dict(cls, hf: dict, extra_eos_token_ids: int | list[int] | None = None) -> HFModelConfig:
        family = _family_of(hf)
        _refuse_unsupported_features(hf)
        num_heads = hf["num_attention_heads"]
        hidden_size = hf["hidden_size"]
        rope_theta, rope_scaling = _parse_rope(hf)
        # Generation stops on any EOS the checkpoint names (Llama 3 instruct lists several in
        # generation_config.json); config.json's come first.
        eos = _as_list(hf.get("eos_token_id")) + _as_list(extra_eos_token_ids)
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden_size,
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=list(dict.fromkeys(eos)),
            bos_token_id=hf.get("bos_token_id"),
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _family_of(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    raise ValueError(
        f"unsupported model architecture {architectures or hf.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse_unsupported_features(hf: dict) -> None:
    max_positions = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    # Qwen2/3 only slide when use_sliding_window is set; Mistral slides whenever a window is given.
    uses_window = hf.get("use_sliding_window", True)
    if uses_window and window is not None and window < max_positions:
        raise ValueError(
            f"sliding-window attention is not supported: sliding_window={window} is smaller than "
            f"max_position_embeddings={max_positions}"
        )
    if "sliding_attention" in (hf.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported: layer_types contains 'sliding_attention'")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true; MLP projections must have no bias")


def _parse_rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5 ``rope_parameters`` or older ``rope_theta``/``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor={params['partial_rotary_factor']}; only 1.0 is supported")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}
