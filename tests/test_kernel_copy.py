"""KV stores and block gather/scatter: Triton kernels (CPU interpreter here) and torch references,
each compared exactly (torch.equal) with a naive Python loop. Destinations start poisoned with NaN
so a slot the kernel forgot to write, or one it should not have touched, is visible."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.block_copy import (
    gather_blocks_reference,
    gather_blocks_triton,
    scatter_blocks_reference,
    scatter_blocks_triton,
)
from kernels.triton.store_kv import store_kv_reference, store_kv_triton

STORE = {"triton": store_kv_triton, "reference": store_kv_reference}
GATHER = {"triton": gather_blocks_triton, "reference": gather_blocks_reference}
SCATTER = {"triton": scatter_blocks_triton, "reference": scatter_blocks_reference}


def is_nan(x: torch.Tensor) -> torch.Tensor:
    return torch.isnan(x.float())


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize(
    "dtype,kv_heads,head_dim,block_size",
    [
        (torch.float32, 1, 64, 8),
        (torch.bfloat16, 4, 128, 16),
        (torch.float16, 3, 64, 16),
    ],
)
def test_store_kv_kernel_writes_exactly_the_mapped_slots(impl, dtype, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    num_blocks, num_tokens = 7, 19
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # scattered across blocks
    # key/value as strided views of a fused QKV projection, like the model produces them
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)

    STORE[impl](key, value, k_cache, v_cache, slots)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], key[token])
        assert torch.equal(v_cache[block, offset], value[token])
        written[slot] = True
    untouched = ~written.view(num_blocks, block_size)
    assert is_nan(k_cache[untouched]).all() and is_nan(v_cache[untouched]).all()


def make_pool(dtype, layers=3, num_blocks=11, block_size=8, kv_heads=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_blocks_kernel_is_exact(impl, dtype):
    pool = make_pool(dtype, seed=1)
    block_ids = torch.tensor([9, 2, 5, 0, 10])
    if impl == "triton":
        out = gather_blocks_triton(pool, block_ids, out=torch.full((3, 2, 5, 8, 2, 64), float("nan"), dtype=dtype))
    else:
        out = gather_blocks_reference(pool, block_ids)
    assert out.shape == (3, 2, 5, 8, 2, 64) and out.dtype == dtype
    for i, block in enumerate(block_ids.tolist()):
        for layer in range(3):
            for kv in range(2):
                assert torch.equal(out[layer, kv, i], pool[layer, kv, block])


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_blocks_kernel_is_exact_and_touches_nothing_else(impl, dtype):
    pool = torch.full((3, 2, 11, 16, 4, 128), float("nan"), dtype=dtype)
    block_ids = torch.tensor([4, 7, 1])
    buffer = make_pool(dtype, num_blocks=3, block_size=16, kv_heads=4, head_dim=128, seed=2)
    SCATTER[impl](pool, block_ids, buffer)
    for i, block in enumerate(block_ids.tolist()):
        assert torch.equal(pool[:, :, block], buffer[:, :, i])
    others = [b for b in range(11) if b not in block_ids.tolist()]
    assert is_nan(pool[:, :, others]).all()


def test_gather_then_scatter_kernel_round_trip_between_pools():
    """What a transport does: pack blocks of one pool, unpack them into other block ids of another."""
    src = make_pool(torch.bfloat16, seed=3)
    dst = torch.zeros_like(src)
    buffer = gather_blocks_triton(src, torch.tensor([3, 8, 1], dtype=torch.int32))
    scatter_blocks_triton(dst, torch.tensor([0, 5, 6]), buffer)
    assert torch.equal(dst[:, :, [0, 5, 6]], src[:, :, [3, 8, 1]])
    assert not dst[:, :, [1, 2, 3, 4, 7, 8, 9, 10]].any()
    assert gather_blocks_triton(src, torch.tensor([], dtype=torch.long)).shape == (3, 2, 0, 8, 2, 64)
