"""A Llama-family causal LM that reads and writes its KV through the node's paged pool.

``forward`` takes one step's flattened varlen batch (prefill chunks and decode tokens together) and
returns the residual stream of every token; ``compute_logits`` applies the final norm and the LM head
to just the rows the runner samples from, so a long prefill chunk pays for one vocab projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.pool import KVPool
from engine.lora.manager import NO_LORA, LoRAStep, LoRAStepRef
from engine.model.config import HFModelConfig
from engine.model.cpu_linear import LM_HEAD_SLICE_ROWS, PLAIN, Linear, MatmulForms, WeightCopies, linear, time_forms
from engine.model.decode_step import FusedDecodeStep
from engine.model.layers import MLP, Attention, DecoderLayer, RMSNorm, meta_parameter
from engine.model.rope import RotaryEmbedding
from engine.step.attention_metadata import AttentionMetadata
from kernels.cpu.native import NativeLibrary


class CausalLM(nn.Module):
    def __init__(self, config: HFModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.embed_tokens = meta_parameter(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints make this the same Parameter as embed_tokens (the loader does it).
        self.lm_head = meta_parameter(config.vocab_size, config.hidden_size)
        # Not a submodule: its float32 table lives on `device` whatever dtype the weights get.
        self.rotary = RotaryEmbedding(config, device)
        self.lm_head_forms = PLAIN  # CPU matmul forms of the LM head (choose_cpu_matmul_forms)
        self.lm_head_copies: WeightCopies | None = None  # the copies of the LM head those forms read
        # A GGUF file's LM head kept in the file's format (engine/model/gguf_quant.py): the logits read it
        # instead of lm_head, as llama.cpp reads `output` (or tied `token_embd`) in its own format.
        self.quantized_head: nn.Module | None = None
        self.native_layer_ops = False  # use_native_layer_ops
        self.fused_decode: FusedDecodeStep | None = None  # use_fused_decode
        self.lora_ref: LoRAStepRef | None = None  # enable_lora: the step's adapters, read by every projection

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the step's new tokens, request after request
        positions: torch.Tensor,  # [T] int64, each token's position in its sequence
        kv_pool: KVPool,
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,  # the step's adapters per token row (None: base only)
    ) -> torch.Tensor:  # [T, hidden], before the final norm
        if self.lora_ref is not None:
            self.lora_ref.step = lora or NO_LORA
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden], a fresh tensor (the residual stream)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # each [T, 1, head_dim / 2], shared by all layers
        if self.native_layer_ops:
            check_slots(meta.slot_mapping, kv_pool.layer(0)[0])  # the C store writes where they point, unchecked
        if self.fused_decode is not None and self.fused_decode.takes(x.shape[0], meta, lora):
            return self.fused_decode.run(x, cos, sin, kv_pool, meta)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv_pool.layer(index), meta)
        return x + residual

    def enable_lora(self) -> None:
        """Let every projection add the step's LoRA deltas (engine/lora/adapter.py names them by layer
        and fused module)."""
        self.lora_ref = LoRAStepRef()
        for index, layer in enumerate(self.layers):
            for name, module in (
                ("qkv_proj", layer.self_attn.qkv_proj),
                ("o_proj", layer.self_attn.o_proj),
                ("gate_up_proj", layer.mlp.gate_up_proj),
                ("down_proj", layer.mlp.down_proj),
            ):
                module.lora_key, module.lora_ref = (index, name), self.lora_ref

    def use_native_layer_ops(self, native: NativeLibrary) -> None:
        """RMSNorm (with its residual add), RoPE with the K/V store and SwiGLU's product in C
        (kernels/cpu/layer_ops.c); for float32 weights on CPU. Qwen3's per-head q/k norms stay in torch,
        and so its RoPE."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.native = native
        self.native_layer_ops = True

    def use_fused_decode(self, native: NativeLibrary) -> bool:
        """Run the decoder layers of a decode step as one C call where the step allows it
        (engine/model/decode_step.py); after ``use_native_layer_ops`` and ``choose_cpu_matmul_forms``.
        Returns whether this model can (see ``FusedDecodeStep.fits``)."""
        self.fused_decode = FusedDecodeStep(self, native) if FusedDecodeStep.fits(self) else None
        return self.fused_decode is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        hidden = self.norm(hidden)
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()  # CUDA's (engine/quant/cuda_linear.py) is in bf16
        if self.lm_head_copies is None:  # no forms chosen (CUDA, or before timing): plain
            return F.linear(hidden, self.lm_head).float()
        return linear(hidden, self.lm_head_copies, forms=self.lm_head_forms).float()

    def choose_cpu_matmul_forms(
        self, native: NativeLibrary | None = None, c_decode_rows: int = 0
    ) -> dict[str, MatmulForms]:
        """Times the plain, transposed and packed matmul forms on this machine, and the C linear of
        ``native`` where given, for every distinct projection shape and the LM head
        (engine/model/cpu_linear.py), at the current thread count, and uses the faster from now on. With
        ``c_decode_rows``, the layers' projections take the C linear up to that many rows whatever the
        timing says (the fused decode step needs it: engine/model/decode_step.py). Returns the choice by
        weight shape, for the log."""
        groups: dict[str, list[Linear]] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                groups.setdefault(f"{module.out_features}x{module.in_features}", []).append(module)
        weights = {key: [m.weight for m in modules] for key, modules in groups.items()}
        if self.quantized_head is None:  # else the float head is only the embedding's table
            weights["lm_head"] = [self.lm_head]
        chosen = time_forms(weights, {"lm_head": LM_HEAD_SLICE_ROWS}, native=native)
        if c_decode_rows and native is not None:
            for key, modules in groups.items():
                if native.takes_weight(modules[0].weight):
                    chosen[key] = chosen[key].with_c_up_to(c_decode_rows, native)
        for key, modules in groups.items():
            for module in modules:
                module.use_forms(chosen[key])
        if self.quantized_head is None:
            self.use_lm_head_forms(chosen["lm_head"])
        return chosen

    def use_lm_head_forms(self, forms: MatmulForms) -> None:
        """As ``Linear.use_forms``, for the LM head: the dense head is freed where no form reads it,
        unless tied (the embedding reads it)."""
        self.lm_head_copies = WeightCopies.make(self.lm_head, forms)
        # Tied, a packed or C head is a second copy (vocab x hidden more memory, e.g. 545 MB for a
        # 151,936 x 896 fp32 head).
        if self.lm_head is not self.embed_tokens and not forms.holds_dense:
            self.lm_head = None
        self.lm_head_forms = forms


def check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Every slot inside the pool (``k_cache``: one layer's [num_blocks, block_size, ...])."""
    if slot_mapping.numel():
        low, high = map(int, torch.aminmax(slot_mapping))
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if low < 0 or high >= num_slots:
            raise IndexError(f"KV slots span {low}..{high}, the pool has {num_slots}")
