"""What a decode step and a prefill must at least cost on a device, from the model's shape alone.

- Decode is bound by memory: each step reads every weight once (the embedding only for the rows it
  looks up, so not counted) and each request's whole KV cache. Roofline tokens/s at batch b =
  b / (bytes read per step / the device's measured copy bandwidth).
- Prefill is bound by compute: 2 FLOPs per weight per token for the linear layers, plus causal
  attention (QK^T and PV: 2 * 2 * heads * head_dim per (query, key) pair, half the square). The LM
  head runs for the last token only (what the engine samples from). Achieved FLOP/s is set against
  the measured rate of one large bfloat16 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> Shape:
        """From engine/model/config.py's HFModelConfig."""
        return cls(
            config.num_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.vocab_size,
            config.tie_word_embeddings,
        )

    @property
    def layer_weights(self) -> int:
        """Weights of the linear layers of one decoder layer (q, k, v, o, gate, up, down)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def norm_weights(self) -> int:
        return self.layers * 2 * self.hidden + self.hidden

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element_bytes

    def decode_step_bytes(self, batch: int, context: int, element_bytes: int) -> int:
        """Bytes one decode step must read: every layer's weights, the norms, the LM head, the KV."""
        weights = self.layers * self.layer_weights + self.norm_weights + self.vocab * self.hidden
        return weights * element_bytes + batch * context * self.kv_bytes_per_token(element_bytes)

    def prefill_flops(self, tokens: int) -> int:
        """FLOPs of one prompt of ``tokens`` from scratch (causal), sampling one token at the end."""
        linear = 2 * self.layers * self.layer_weights * tokens
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * (tokens * (tokens + 1) // 2)
        return linear + attention + 2 * self.vocab * self.hidden


def roofline_tokens_per_s(shape: Shape, batch: int, context: int, element_bytes: int, copy_gbps: float) -> float:
    """Decode output tokens/s if a step took exactly its bytes at the measured copy bandwidth."""
    return batch / (shape.decode_step_bytes(batch, context, element_bytes) / (copy_gbps * 1e9))
