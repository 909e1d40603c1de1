"""The C norm, RoPE and SwiGLU kernels (kernels/cpu/layer_ops.c) against float64 references, in every build of
the C library (tests/conftest.py: with and without OpenMP, 4-, 8- and 16-float vectors). Their use in
the model is checked against transformers in tests/test_model_parity.py."""

from __future__ import annotations

import pytest
import torch

from configs.schema import EngineConfig, ModelConfig
from engine.llm import build_engine
from engine.model.model import check_slots
from kernels.cpu import native as cpu_native
from tests.model_factory import tiny_model_dir

SENTINEL = 7.0  # what the caches and padding hold before a call: the kernel must write exactly its slots


def _rms_norm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return weight.double() * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 3, 130])  # 130: past the rows that split across threads
@pytest.mark.parametrize("dim", [512, 72, 24])  # 72, 24: a tail past the last whole vector
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(any_build, rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows * dim)
    wide = torch.randn(rows, dim + 8, generator=gen)
    x = wide[:, :dim]  # rows strided: the kernel reads x in place
    weight = torch.randn(dim, generator=gen)
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    before, wide_before = (residual.clone() if with_residual else None), wide.clone()
    out = any_build.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(wide, wide_before)  # x (and the columns beside it) read only
    if with_residual:
        assert torch.equal(residual, x + before)  # the stream, updated in place: the float32 sum exactly
    expected = _rms_norm_reference(x + before if with_residual else x, weight, 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] float64, rotate-half pairing; cos/sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 16), (2, 1, 128)])
def test_rope_store_rotates_q_and_k_and_stores_k_and_v_at_their_slots(any_build, tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens * heads * head_dim)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    wide = torch.randn(tokens, q_size + 2 * kv_size + 5, generator=gen)
    qkv = wide[:, : q_size + 2 * kv_size]  # rows strided, as a slice of a wider projection
    original = wide.clone()
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 1000
    cos, sin = angles.cos(), angles.sin()
    block_size, num_blocks = 4, 40
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]  # any slots, in any order
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), SENTINEL)
    v_cache = torch.full_like(k_cache, SENTINEL)

    any_build.rope_store(qkv, heads, kv_heads, cos, sin, slots, k_cache, v_cache)

    before = original[:, : q_size + 2 * kv_size]
    q0 = before[:, :q_size].reshape(tokens, heads, head_dim).double()
    k0 = before[:, q_size : q_size + kv_size].reshape(tokens, kv_heads, head_dim).double()
    q, k = qkv[:, :q_size].reshape(tokens, heads, head_dim), qkv[:, q_size : q_size + kv_size]
    torch.testing.assert_close(q.double(), _rotate_reference(q0, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        k.reshape(tokens, kv_heads, head_dim).double(), _rotate_reference(k0, cos, sin), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # v as it was
    assert torch.equal(wide[:, q_size + 2 * kv_size :], original[:, q_size + 2 * kv_size :])  # past the row: untouched
    flat_k, flat_v = k_cache.view(-1, kv_size), v_cache.view(-1, kv_size)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], qkv[:, q_size + kv_size :])
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slots] = False
    assert bool((flat_k[others] == SENTINEL).all()) and bool((flat_v[others] == SENTINEL).all())


@pytest.mark.parametrize("rows", [1, 70])
@pytest.mark.parametrize("inter", [1536, 40])  # 40: a tail past the last whole vector
def test_silu_mul_matches_float64(any_build, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    wide = torch.randn(rows, 2 * inter + 3, generator=gen) * 6  # e^-x from ~e^-30 to ~e^30
    wide[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # past exp's clamps, and both zeros
    gate_up, before = wide[:, : 2 * inter], wide.clone()
    out = any_build.silu_mul(gate_up)
    assert torch.equal(wide, before) and out.shape == (rows, inter) and out.is_contiguous()
    gate, up = gate_up.double().split(inter, dim=1)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, atol=1e-6, rtol=1e-5)


def test_a_slot_outside_the_pool_is_refused_before_any_write():
    k_cache = torch.zeros(3, 4, 2, 8)  # 12 slots
    check_slots(torch.tensor([0, 11, 5]), k_cache)
    for bad, span in (([0, 12], "0..12"), ([-1, 3], "-1..3")):
        with pytest.raises(IndexError, match=f"KV slots span {span}, the pool has 12"):
            check_slots(torch.tensor(bad), k_cache)


@pytest.mark.parametrize("setting,expected", [("c", True), ("torch", False)])
def test_the_engine_setting_picks_the_path(library, setting, expected):
    path = tiny_model_dir("llama")
    engine = build_engine(
        path,
        ModelConfig(path=path, dtype="float32"),
        EngineConfig(kv_cache_memory_mb=4, cpu_layer_ops=setting),
        device="cpu",
    )
    native = cpu_native.load()  # the loader's current library (other tests rebuild its cache)
    model = engine.runner.model
    assert model.native_layer_ops is expected
    for layer in model.layers:
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp):
            assert (module.native is native) is expected
