"""Compute roofline of a decoder run: the FLOPs a workload needs, and how fast this machine does matmuls.

    roofline fraction = required FLOPs / measured matmul FLOP/s / measured wall time

1.0 would mean every second went into useful matmul work at the machine's matmul speed. Required
FLOPs count what a KV-cached engine cannot avoid, not what it happens to do:

    linear layers   2 * (per-layer linear params * layers) per processed token
    lm_head         2 * hidden * vocab per *sampled* position only
    attention       per layer, a query at position p reads p + 1 keys: QK^T and PV each
                    2 * heads * head_dim * (p + 1)  (causal: the masked half is not required)

A request with P prompt tokens and L output tokens processes P + L - 1 tokens (its last sampled
token is never fed back) at positions 0 .. P + L - 2, and samples L times.

A second roofline, ``roofline_vs_fastest_matmul``, also prices the bytes a KV-cached engine cannot
avoid moving, and takes the larger of the two times (FLOP/s and bandwidth measured by
benchmarks/engine/fastest_matmul.py):

    ideal = max(required FLOPs / fastest matmul FLOP/s, required bytes / memory bandwidth)
    required bytes  every weight of the projections and the LM head, once per forward pass, and at
                    least max(L) passes (the longest request's prefill, then its L - 1 decode steps
                    one after another); plus each decode token's read of its context's K and V

Both times are lower bounds under a relaxed schedule (every FLOP may run in any pass), so the larger
is one too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.cpu_linear import best_seconds


@dataclass(slots=True, frozen=True)
class DecoderShape:
    """The sizes of a Llama-family decoder that its FLOPs depend on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config) -> DecoderShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
        )

    @property
    def linear_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        gate_up_down = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + gate_up_down

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each distinct projection, fused as engines fuse them: qkv, o, gate_up, down."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return [
            (self.hidden_size, qkv),
            (self.num_heads * self.head_dim, self.hidden_size),
            (self.hidden_size, 2 * self.intermediate_size),
            (self.intermediate_size, self.hidden_size),
        ]


def linear_flops(shape: DecoderShape, num_tokens: int, num_sampled: int) -> float:
    """Decoder-layer projections over ``num_tokens`` tokens plus lm_head over ``num_sampled`` rows."""
    layers = 2.0 * shape.linear_params_per_layer * shape.num_layers * num_tokens
    lm_head = 2.0 * shape.hidden_size * shape.vocab_size * num_sampled
    return layers + lm_head


def causal_attention_flops(shape: DecoderShape, num_positions: int) -> float:
    """QK^T and PV for queries at positions 0 .. num_positions - 1 of one sequence, all layers."""
    keys_read = num_positions * (num_positions + 1) // 2  # sum over p of (p + 1)
    return 4.0 * shape.num_heads * shape.head_dim * keys_read * shape.num_layers


def request_flops(shape: DecoderShape, prompt_len: int, output_len: int) -> float:
    processed = prompt_len + output_len - 1
    return linear_flops(shape, processed, output_len) + causal_attention_flops(shape, processed)


def workload_flops(shape: DecoderShape, lengths: list[tuple[int, int]]) -> float:
    """Required FLOPs of a workload given as (prompt_len, output_len) pairs."""
    return sum(request_flops(shape, p, o) for p, o in lengths)


def weight_bytes(shape: DecoderShape, dtype_bytes: int = 4) -> int:
    """The projections of every layer and the LM head: what one forward pass reads at least once."""
    return dtype_bytes * (shape.linear_params_per_layer * shape.num_layers + shape.hidden_size * shape.vocab_size)


def min_forward_passes(lengths: list[tuple[int, int]]) -> int:
    """A request with L outputs needs L passes one after another (prefill samples the first token)."""
    return max((out for _, out in lengths), default=0)


def decode_kv_bytes(shape: DecoderShape, lengths: list[tuple[int, int]], dtype_bytes: int = 4) -> int:
    """K and V a decode step reads: the token at position p reads p + 1 positions of every layer. A
    request decodes positions P .. P + L - 2 (its L - 1 decode steps)."""
    per_position = 2 * shape.num_kv_heads * shape.head_dim * shape.num_layers * dtype_bytes
    positions = 0
    for prompt, out in lengths:
        first, last = prompt + 1, prompt + out - 1  # p + 1 over p = P .. P + L - 2
        positions += (first + last) * (last - first + 1) // 2 if last >= first else 0
    return per_position * positions


def workload_bytes(shape: DecoderShape, lengths: list[tuple[int, int]], dtype_bytes: int = 4) -> int:
    """Required bytes moved: weights once per pass over the fewest passes, and the decode steps' KV reads."""
    return min_forward_passes(lengths) * weight_bytes(shape, dtype_bytes) + decode_kv_bytes(shape, lengths, dtype_bytes)


@dataclass(slots=True, frozen=True)
class Roofline:
    """``max(flop time, bytes time)`` of a workload at a machine's peak rates."""

    flops: float
    flops_per_s: float
    num_bytes: float
    bytes_per_s: float

    @property
    def flop_s(self) -> float:
        return self.flops / self.flops_per_s

    @property
    def bytes_s(self) -> float:
        return self.num_bytes / self.bytes_per_s

    @property
    def ideal_s(self) -> float:
        return max(self.flop_s, self.bytes_s)

    @property
    def bound(self) -> str:
        return "FLOP" if self.flop_s >= self.bytes_s else "memory"

    def fraction(self, wall_s: float) -> float:
        return self.ideal_s / wall_s


def measure_matmul_flops(shape: DecoderShape, num_rows: int = 512, repeats: int = 5) -> float:
    """fp32 ``torch.mm`` FLOP/s on the model's projection shapes, at the current torch thread count.

    ``num_rows`` is the token count of a large batched step. Each shape is timed ``repeats`` times
    after a warm-up and its best time kept (the roofline is what the machine *can* do).
    """
    total_flops, total_s = 0.0, 0.0
    gen = torch.Generator().manual_seed(0)
    for d_in, d_out in shape.linear_shapes():
        x = torch.randn(num_rows, d_in, generator=gen)  # [rows, in]
        w = torch.randn(d_in, d_out, generator=gen)  # [in, out]
        total_flops += 2.0 * num_rows * d_in * d_out
        total_s += best_seconds(lambda: torch.mm(x, w), repeats)  # [rows, out]; warmed up once first
    return total_flops / total_s


def roofline_fraction(required_flops: float, flops_per_s: float, wall_s: float) -> float:
    return required_flops / flops_per_s / wall_s
