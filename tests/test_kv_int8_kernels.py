"""The int8 KV pool's C writer and prefill reader (kernels/cpu/kv_int8_ops.c): the RoPE + quantizing
store against torch's rotation in float64 and kv_int8.quantize_rows, byte for byte; the prefill
attention against float64 attention over the dequantized pool, on irregular shapes and chunks."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.kv_int8 import Int8KV
from kernels.triton import kv_int8
from tests.test_kv_int8 import attention_float64


@pytest.fixture(scope="module")
def kernels(any_build) -> Int8KV:
    """Every build the tests make (conftest.BUILDS): the vector quantizer and its lane-by-lane stores."""
    return Int8KV(any_build)


def rotated_float64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated as the engine rotates (halves, engine/model/rope.py), in float64."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,tokens",
    [(9, 3, 64, 70), (4, 2, 16, 5), (8, 1, 128, 3), (3, 1, 12, 7)],  # 12: a group of no whole vector at 8 or 16 lanes
)
def test_rope_store_quantizes_as_the_torch_quantizer(kernels, num_heads, kv_heads, head_dim, tokens):
    g = torch.Generator().manual_seed(tokens)
    width = (num_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 3, generator=g)[:, :width]  # strided rows, as a fused projection's view
    qkv[:, -head_dim:] *= 40.0  # one wide value head: its scale differs from the others'
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    slots_total, row = tokens + 30, kv_int8.row_dim(head_dim)
    k_cache = torch.zeros(slots_total, kv_heads, row, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(slots_total, generator=g)[:tokens].contiguous()
    kernels.rope_store(qkv, num_heads, kv_heads, cos, sin, slots, k_cache, v_cache)

    qk = before[:, : (num_heads + kv_heads) * head_dim].view(tokens, num_heads + kv_heads, head_dim)
    want = rotated_float64(qk, cos, sin)
    got = qkv[:, : (num_heads + kv_heads) * head_dim].view(tokens, num_heads + kv_heads, head_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)  # q and k rotated in place
    # The stored rows are the torch quantizer's of what the kernel rotated, to the bit.
    k_rot = got[:, num_heads:]
    v = before[:, (num_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    assert torch.equal(k_cache[slots], kv_int8.quantize_rows(k_rot))
    assert torch.equal(v_cache[slots], kv_int8.quantize_rows(v))
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()  # no other slot written
    # And within half a quantization step of the float64 truth.
    step = kv_int8.scales(k_cache[slots]).double().repeat_interleave(kv_int8.group_size(head_dim), -1)
    err = (kv_int8.dequantize_rows(k_cache[slots]).double() - want[:, num_heads:]).abs()
    assert bool((err <= step / 2 + 1e-5 * want[:, num_heads:].abs() + 1e-6).all())


def test_rope_store_rounds_half_to_even_as_torch(kernels):
    """Ties: with amax 127 the scale is 1 (exact in float16), so x.5 values land exactly halfway;
    torch.round and the kernel's vector rounding both take the even neighbour (0.5 -> 0, 1.5 -> 2,
    -2.5 -> -2). Every group of 16 holds a 127."""
    num_heads, kv_heads, head_dim = 1, 1, 64
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    group = torch.cat([ties, ties[:-1], torch.tensor([127.0])])
    values = torch.cat([group, -group.flip(0), group.flip(0), -group])
    qkv = torch.cat([torch.zeros(2 * head_dim), values]).view(1, -1)
    cos, sin = torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)
    k_cache = torch.zeros(1, kv_heads, kv_int8.row_dim(head_dim), dtype=torch.int8)
    v_cache = k_cache.clone()
    kernels.rope_store(qkv, num_heads, kv_heads, cos, sin, torch.tensor([0]), k_cache, v_cache)
    assert torch.equal(v_cache[0, 0], kv_int8.quantize_rows(values.view(1, head_dim))[0])
    assert v_cache[0, 0, :8].tolist() == [0, 2, 2, 0, -2, -2, 126, -126]


def test_rope_store_rounds_the_float32_product_as_torch(kernels):
    """x * (1 / scale) is rounded to float32 first, then to an integer: torch's two roundings. Each x
    here makes that product exactly k + 0.5 in float32 while the exact product lies just off the tie,
    so rounding the exact product (an FMA of x * inv + 1.5 * 2^23) would land on the other neighbour
    where the tie goes down (k even and the exact product above it: 0 and 6 here)."""
    num_heads, kv_heads, head_dim = 1, 1, 32
    amax = torch.tensor(3.0)
    scale = (amax / torch.tensor(127.0)).half().float()  # the stored float16 scale, 0.02362060546875
    x = torch.tensor([0.011810302734375, 0.035430908203125, 0.0590515099465847, 0.082672119140625])
    x = torch.cat([x, torch.tensor([0.1062927171587944, 0.129913330078125, 0.153533935546875])])
    product = x * (torch.tensor(1.0) / scale)  # float32, the quotient correctly rounded
    assert product.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]  # exact ties once rounded to float32
    assert (x.double() * (torch.tensor(1.0) / scale).double()).tolist() != product.double().tolist()
    values = torch.cat([x, -x, amax.view(1), torch.zeros(head_dim - 2 * len(x) - 1)])  # amax in the first group
    qkv = torch.cat([torch.zeros(2 * head_dim), values]).view(1, -1)
    cos, sin = torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)
    k_cache = torch.zeros(1, kv_heads, kv_int8.row_dim(head_dim), dtype=torch.int8)
    v_cache = k_cache.clone()
    kernels.rope_store(qkv, num_heads, kv_heads, cos, sin, torch.tensor([0]), k_cache, v_cache)
    assert v_cache[0, 0, :14].tolist() == [0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -4, -4, -6, -6]
    assert torch.equal(v_cache[0, 0], kv_int8.quantize_rows(values.view(1, head_dim))[0])


def test_rope_store_stores_zeros_below_float16s_scales(kernels):
    """amax / 127 below float16's smallest subnormal: the stored scale is 0, so the group stores zeros
    (never an infinite inverse), as torch's quantizer does; the other group keeps its own scale."""
    num_heads, kv_heads, head_dim = 1, 1, 32
    values = torch.zeros(head_dim)
    values[[0, 1, 2, 5]] = torch.tensor([1e-38, -5e-39, 2e-39, -1e-38])
    values[16:] = torch.linspace(-2.0, 2.0, 16)
    qkv = torch.cat([torch.zeros(2 * head_dim), values]).view(1, -1)
    cos, sin = torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)
    k_cache = torch.zeros(1, kv_heads, kv_int8.row_dim(head_dim), dtype=torch.int8)
    v_cache = k_cache.clone()
    kernels.rope_store(qkv, num_heads, kv_heads, cos, sin, torch.tensor([0]), k_cache, v_cache)
    assert not v_cache[0, 0, :16].any()
    assert kv_int8.scales(v_cache[0]).tolist() == [[0.0, float((torch.tensor(2.0) / 127).half())]]
    assert torch.equal(v_cache[0, 0], kv_int8.quantize_rows(values.view(1, head_dim))[0])


def test_rope_store_keeps_an_all_zero_group_at_scale_zero(kernels):
    num_heads, kv_heads, head_dim = 2, 1, 64
    qkv = torch.zeros(1, (num_heads + 2 * kv_heads) * head_dim)
    qkv[0, -head_dim:-32] = torch.linspace(-1, 1, 32)  # V's first two groups nonzero, its last two all zero
    cos, sin = torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)
    k_cache = torch.full((4, kv_heads, kv_int8.row_dim(head_dim)), 7, dtype=torch.int8)
    v_cache = k_cache.clone()
    kernels.rope_store(qkv, num_heads, kv_heads, cos, sin, torch.tensor([2]), k_cache, v_cache)
    one = float((torch.tensor(1.0) / 127).half())  # float16(amax / 127), amax 1 in each of the first two groups
    assert kv_int8.scales(v_cache[2]).tolist() == [[one, one, 0.0, 0.0]]
    assert not v_cache[2, 0, 32:64].any() and not kv_int8.scales(k_cache[2]).any()
    assert (k_cache[[0, 1, 3]] == 7).all()


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,block_size,ctx,q_lens",
    [
        (9, 3, 64, 16, [37, 200, 5], [37, 70, 1]),  # a first chunk, a later chunk, a decode row
        (4, 2, 16, 4, [19, 33], [19, 17]),
        (8, 1, 128, 8, [90], [33]),
        (2, 2, 32, 16, [1, 64], [1, 64]),
        (4, 2, 64, 16, [300, 90], [200, 90]),  # tasks of 4 query tiles sharing each key tile, and a last short one
    ],
)
def test_prefill_reads_int8_as_the_float64_reference(kernels, num_heads, kv_heads, head_dim, block_size, ctx, q_lens):
    g = torch.Generator().manual_seed(sum(ctx))
    num_blocks = sum(-(-c // block_size) for c in ctx) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g) * 3)
    v_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g))
    width = max(-(-c // block_size) for c in ctx)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx), width, dtype=torch.int64)
    used = 0
    for i, c in enumerate(ctx):
        n = -(-c // block_size)
        tables[i, :n] = ids[used : used + n]
        used += n
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(q_start[-1]), num_heads, head_dim, generator=g)
    context_lens, scale = torch.tensor(ctx), head_dim**-0.5
    got = kernels.prefill(q, k_cache, v_cache, tables, context_lens, q_start, scale)
    want = attention_float64(q, k_cache, v_cache, tables, context_lens, q_start, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
