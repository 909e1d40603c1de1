"""The pieces of one Llama-family decoder layer, over a flattened varlen batch of T tokens.

Weights are stored fused for CPU speed (one matmul instead of three / two): ``qkv_proj`` holds
``[q; k; v]`` rows and ``gate_up_proj`` holds ``[gate; up]`` rows. The loader does the fusing.
Parameters are created on the meta device (no memory); the loader materialises every one of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.model.config import HFModelConfig
from engine.model.cpu_linear import Linear
from engine.model.rope import apply_rotary
from engine.step.attention_metadata import AttentionMetadata
from kernels.cpu.kv_int8 import int8_kernels
from kernels.cpu.native import NativeLibrary


def meta_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return Linear(in_features, out_features, bias=bias, device="meta").requires_grad_(False)


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight multiply, as transformers does.

    ``norm(x)`` returns the normalised x; ``norm(x, residual)`` adds x to the residual stream first and
    returns (normalised sum, sum), as vLLM's fused_add_rms_norm: the layer's two residual adds ride
    on its norms. With ``native`` set (CPU, float32) 2-D inputs take the C kernel, which updates
    ``residual`` in place; the torch path leaves its inputs alone."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = meta_parameter(dim)
        self.eps = eps
        self.native: NativeLibrary | None = None  # set by CausalLM.use_native_layer_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.native is not None and x.dim() == 2:
            out = self.native.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: HFModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = _linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.native: NativeLibrary | None = None  # set by CausalLM.use_native_layer_ops: RoPE + K/V store in C

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim / 2]
        sin: torch.Tensor,  # [T, 1, head_dim / 2]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        k_cache, v_cache = kv_cache
        if self.native is not None and self.q_norm is None and k_cache.dtype in (torch.float32, torch.int8):
            # q and k rotated in place in qkv, k and v stored (an int8 pool's quantized as they are):
            # q stays a strided view of qkv.
            store = self.native if k_cache.dtype == torch.float32 else int8_kernels(self.native)
            store.rope_store(qkv, self.num_heads, self.num_kv_heads, cos, sin, meta.slot_mapping, k_cache, v_cache)
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            return self._attend(q, k_cache, v_cache, meta)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is None:
            # q and k sit side by side in qkv: rotate them as one [T, H + KVH, D] tensor.
            num_qk_heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim)
            q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, KVH, D]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta)

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:  # q [T, H, D] -> [T, hidden]
        out = kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, self.scale, meta.plan
        )  # [T, H, D]
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, config: HFModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, bias=False)
        self.native: NativeLibrary | None = None  # set by CausalLM.use_native_layer_ops: the product in C

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate], a fresh tensor nothing else holds
        if self.native is not None:
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place: two fewer [T, intermediate] tensors to allocate and stream through memory
        # (measured -10% per 2048-token prefill step on CPU); the dense down_proj forms read the strided
        # view as is, the packed one copies it contiguous first (engine/model/cpu_linear.py).
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for the first layer), residual: the residual
        stream before it (None for the first). Returns this layer's output and the stream before it;
        their sum is what transformers' layer returns."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
