"""Rotary position embedding, bit-for-bit the computation of transformers' Llama rotary embedding.

The cos/sin table is built once per device up to the largest position seen (grown by doubling) and
indexed by each token's position, so a varlen batch of chunks at arbitrary offsets costs one gather.
Each table entry is ``cos(float(pos) * inv_freq)`` in float32, exactly as transformers computes it.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import HFModelConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, with ``linear`` or ``llama3`` scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    assert scaling["rope_type"] == "llama3", scaling
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds the cos/sin table; not an nn.Module so ``model.to()`` never touches its float32 table.

    transformers' table is ``cat(freqs, freqs)``: both halves are equal, so we keep one half.
    """

    def __init__(self, config: HFModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
        self.cos = torch.empty(0, config.head_dim // 2, device=device)  # [cached_positions, head_dim / 2] f32
        self.sin = torch.empty(0, config.head_dim // 2, device=device)
        # Long-context models would spend 100+ MB on a full table; grow on demand past 8K instead.
        self._grow(min(config.max_position_embeddings, 8192))

    def _grow(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        freqs = positions[:, None].float() * self.inv_freq  # [P, head_dim / 2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each token: ``[T, 1, head_dim / 2]`` in ``dtype`` (broadcast over heads)."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._grow(2 * int(positions.max()) + 1)
        cos = self.cos[positions].to(dtype)[:, None, :]  # [T, 1, D/2]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, head_dim]``; cos/sin: ``[T, 1, head_dim / 2]``.

    Same values as transformers' ``x * cos + rotate_half(x) * sin`` (``a + (-b) * s == a - b * s``
    exactly in floating point), without materialising ``rotate_half`` or the negation.
    """
    x1, x2 = x.chunk(2, dim=-1)  # each [T, heads, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
