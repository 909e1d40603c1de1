"""Load a Hugging Face Llama-family checkpoint (local directory or hub id) into our ``CausalLM``.

1. resolve the directory (configs/model_source.py: hub ids through ``huggingface_hub.snapshot_download``);
2. parse ``config.json`` into an ``HFModelConfig`` (refusing what we do not support);
3. open every safetensors file (one, or the shards an index names) lazily, or the GGUF file the
   directory was materialised from (engine/model/gguf_tensors.py);
4. check each expected tensor exists with the expected shape, then fuse q/k/v and gate/up rows and
   materialise our parameters directly in the target dtype and device.
With ``load_format="dummy"`` steps 3-4 are random weights made on the device (dummy_weights.py).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from configs.gguf_source import find_gguf
from configs.model_source import ModelSourceError, resolve_model
from engine.model.config import HFModelConfig
from engine.model.dummy_weights import fill_dummy
from engine.model.gguf_quant import keep_quantized
from engine.model.gguf_tensors import GGUFTensors
from engine.model.model import CausalLM

LOAD_FORMATS = ("auto", "dummy")  # as vLLM's --load-format names them
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(
    model: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
) -> tuple[CausalLM, HFModelConfig]:
    """Default dtype: float32 on CPU, bfloat16 on CUDA. Returns the model in eval mode, no grads.
    ``load_format`` "dummy": random weights on the device, only config.json read (dummy_weights.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    path = resolve_model(str(model))
    try:
        config = HFModelConfig.from_hf_dir(path)
    except ValueError as exc:  # what the engine cannot run (sliding windows, other RoPE types, ...)
        raise ModelSourceError(f"model {str(model)!r}: {exc}") from None
    device = torch.device(device)
    dtype = _resolve_dtype(dtype, device)
    lm = CausalLM(config, device)
    if load_format == "dummy":
        fill_dummy(lm, config, dtype, device)
        return lm.eval(), config
    with ExitStack() as stack:
        gguf_file = find_gguf(path)  # a GGUF's materialised directory points at the file (configs/gguf_source.py)
        if gguf_file is not None:
            tensors = GGUFTensors(gguf_file, config.num_heads, config.num_kv_heads)
        else:
            tensors = _open_checkpoint(path, stack)
        _fill_parameters(lm, config, tensors, dtype, device)
        if gguf_file is not None and (device.type == "cuda" or (device.type == "cpu" and dtype == torch.float32)):
            keep_quantized(lm, tensors, device, dtype)  # C kernels on CPU float32, Triton on CUDA (gguf_quant.py)
    return lm.eval(), config


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


class _Tensors:
    """Name -> lazily read tensor across all safetensors files of a checkpoint."""

    def __init__(self, handles: dict[str, object]):
        self._handles = handles  # tensor name -> open safe_open handle of its file

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        handle = self._handles.get(name)
        if handle is None:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        found = tuple(handle.get_slice(name).get_shape())
        if found != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(found)}; this config expects {list(shape)}")
        return handle.get_tensor(name)


def _open_checkpoint(path: Path, stack: ExitStack) -> _Tensors:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    handles: dict[str, object] = {}
    for file in files:
        handle = stack.enter_context(safe_open(str(path / file), framework="pt"))
        for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            handles[name] = handle
    return _Tensors(handles)


def _fill_parameters(lm: CausalLM, config: HFModelConfig, tensors: _Tensors, dtype, device) -> None:
    h, d = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d

    def put(module: nn.Module, name: str, *parts: torch.Tensor) -> None:
        # Rows of the parts, concatenated in order: one fused weight, in the target dtype/device.
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        module._parameters[name] = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)

    def get(name: str, *shape: int) -> torch.Tensor:
        return tensors.get(name, shape)

    put(lm, "embed_tokens", get("model.embed_tokens.weight", config.vocab_size, h))
    put(lm.norm, "weight", get("model.norm.weight", h))
    if config.tie_word_embeddings:
        lm._parameters["lm_head"] = lm.embed_tokens
    else:
        put(lm, "lm_head", get("lm_head.weight", config.vocab_size, h))
    for i, layer in enumerate(lm.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        put(layer.input_layernorm, "weight", get(p + "input_layernorm.weight", h))
        put(layer.post_attention_layernorm, "weight", get(p + "post_attention_layernorm.weight", h))
        put(
            attn.qkv_proj,
            "weight",
            get(p + "self_attn.q_proj.weight", q_size, h),
            get(p + "self_attn.k_proj.weight", kv_size, h),
            get(p + "self_attn.v_proj.weight", kv_size, h),
        )
        if config.attention_bias:
            put(
                attn.qkv_proj,
                "bias",
                get(p + "self_attn.q_proj.bias", q_size),
                get(p + "self_attn.k_proj.bias", kv_size),
                get(p + "self_attn.v_proj.bias", kv_size),
            )
        put(attn.o_proj, "weight", get(p + "self_attn.o_proj.weight", h, q_size))
        if config.qk_norm:
            put(attn.q_norm, "weight", get(p + "self_attn.q_norm.weight", d))
            put(attn.k_norm, "weight", get(p + "self_attn.k_norm.weight", d))
        inter = config.intermediate_size
        put(
            mlp.gate_up_proj,
            "weight",
            get(p + "mlp.gate_proj.weight", inter, h),
            get(p + "mlp.up_proj.weight", inter, h),
        )
        put(mlp.down_proj, "weight", get(p + "mlp.down_proj.weight", h, inter))
    still_meta = [name for name, param in lm.named_parameters() if param.is_meta]
    assert not still_meta, f"parameters left unloaded: {still_meta}"
