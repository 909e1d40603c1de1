"""The int8 decode-attention kernel (kernels/cpu/decode_int8.c) against float64 attention over the
dequantized pool, in every build the tests make (each vector width, with and without OpenMP): GQA
groups 1-8, head sizes 16-128 (one scale group and several), contexts that end inside a vector of
tokens, on a block boundary, before and past the prefetch distance, one sequence and many."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.kv_int8 import Int8KV
from kernels.triton import kv_int8
from tests.test_kv_int8 import attention_float64


def paged_pool(contexts: list[int], block_size: int, kv_heads: int, head_dim: int, g: torch.Generator):
    """Quantized K/V pools with each request's blocks at random places, and the block tables."""
    width = max(-(-c // block_size) for c in contexts)
    num_blocks = len(contexts) * width + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g) * 3)
    v_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g))
    tables = torch.randperm(num_blocks, generator=g)[: len(contexts) * width].view(len(contexts), width)
    return k_cache, v_cache, tables.contiguous()


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,block_size,contexts",
    [
        (9, 3, 64, 16, [384, 1, 33, 16, 17, 250]),  # SmolLM2's heads; block boundaries and odd tails
        (4, 4, 32, 8, [5, 40]),  # no GQA, one scale group
        (8, 4, 16, 4, [1, 2, 3, 31]),  # a head narrower than a scale group
        (8, 1, 128, 16, [129]),  # one sequence, eight query heads on one KV head, four scale groups
        (14, 2, 64, 32, [95, 64, 7]),  # groups of 7
    ],
)
def test_decode_reads_int8_as_the_float64_reference(any_build, num_heads, kv_heads, head_dim, block_size, contexts):
    g = torch.Generator().manual_seed(sum(contexts) + head_dim)
    k_cache, v_cache, tables = paged_pool(contexts, block_size, kv_heads, head_dim, g)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=g)
    context_lens, scale = torch.tensor(contexts), head_dim**-0.5
    got = Int8KV(any_build).decode(q, k_cache, v_cache, tables, context_lens, max(contexts), scale)
    want = attention_float64(q, k_cache, v_cache, tables, context_lens, torch.arange(len(contexts) + 1), scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_reads_only_its_context(any_build):
    """Rows past a request's context (the rest of its last block, other requests' blocks) do not move
    its output: poisoned with huge values, the result is the same bits."""
    g = torch.Generator().manual_seed(7)
    contexts, block_size = [21, 50], 16
    k_cache, v_cache, tables = paged_pool(contexts, block_size, 3, 64, g)
    q = torch.randn(2, 9, 64, generator=g)
    context_lens = torch.tensor(contexts)
    clean = Int8KV(any_build).decode(q, k_cache, v_cache, tables, context_lens, 64, 0.125)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for i, ctx in enumerate(contexts):
        for t in range(ctx):
            used[tables[i, t // block_size], t % block_size] = True
    k_cache[~used], v_cache[~used] = 127, 127  # values and scale bytes alike
    poisoned = Int8KV(any_build).decode(q, k_cache, v_cache, tables, context_lens, 64, 0.125)
    assert torch.equal(clean, poisoned)
