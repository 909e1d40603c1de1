"""The 8-bit KV caches in the Triton kernels, under the CPU interpreter (tests/conftest.py): the store
against the torch reference byte for byte, and decode (split-K too) and chunked-prefill attention over
int8 and e4m3 pools against a float64 attention over the same pool dequantized (``kv_int8.dequantize_rows``,
e4m3's own upcast), at the float32 tolerance of tests/test_kernel_attention.py.

What the interpreter cannot check: its float32 -> e4m3 cast is not round-to-nearest-even (it drops the
carry when the mantissa rounds up, 31.1 becomes 16, and truncates into e4m3's subnormals, 0.003
becomes 0.00195 where it should round to 0.0039), so the fp8 store is
checked here on values e4m3 holds exactly and on values past +-448, where only the clamp decides; the
rounding of every other value is checked on a GPU (tests/gpu/test_gpu_kv_dtypes.py). The int8 store
does its own rounding in float32 arithmetic and is checked bit for bit here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.triton import kv_int8
from kernels.triton.block_copy import gather_blocks_triton, scatter_blocks_triton
from kernels.triton.paged_decode import paged_decode_triton
from kernels.triton.paged_prefill import paged_prefill_triton
from kernels.triton.store_kv import FP8_MAX, store_kv_reference, store_kv_triton
from tests.test_kernel_attention import assert_matches_naive, make_case, poisoned_like

FP8 = torch.float8_e4m3fn


def stored(store, key, value, dtype, num_blocks=4, block_size=4):
    """Fresh pools (poisoned: every byte 0x55) after ``store`` wrote ``key``/``value`` at fixed slots."""
    kv_heads, head_dim = key.shape[1:]
    row = kv_int8.row_dim(head_dim) if dtype == torch.int8 else head_dim
    k_cache = torch.full((num_blocks, block_size, kv_heads, row), 0x55, dtype=torch.uint8).view(dtype)
    v_cache = k_cache.clone()
    slots = torch.tensor([13, 0, 6, 7, 2, 9][: key.shape[0]])
    store(key, value, k_cache, v_cache, slots)
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8)


def int8_inputs(kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Six tokens: scales far apart per head, exact ties, an all-zero group, one below float16's range,
    one past float16's largest scale; K and V sliced out of one fused tensor (strided like the model's)."""
    g = torch.Generator().manual_seed(kv_heads * head_dim)
    fused = torch.randn(6, 2 * kv_heads, head_dim, generator=g) * torch.logspace(-2, 1.5, 2 * kv_heads)[None, :, None]
    gs = kv_int8.group_size(head_dim)
    # ties: scale 0.5 exactly (amax 63.5), values (n + 0.5) * 0.5 land on n + 0.5 against 1 / scale = 2
    ties = (torch.arange(gs) - gs // 2 + 0.5) * 0.5
    ties[0] = 63.5
    fused[1, 0, :gs] = ties
    fused[2, 1, :gs] = 0.0  # scale 0: zeros
    fused[3, 0, :gs] *= 1e-9  # amax / 127 below float16's smallest subnormal: zeros
    fused[4, 1, :gs] *= 1e9  # amax / 127 past 65504: the largest float16 scale, values clamped at 127
    fused = fused.to(dtype)
    return fused[:, :kv_heads], fused[:, kv_heads:]


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 64), (1, 128), (2, 8), (2, 10), (3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_store_writes_the_reference_bytes(kv_heads, head_dim, dtype):
    key, value = int8_inputs(kv_heads, head_dim, dtype)
    assert key.stride(0) != kv_heads * head_dim  # strided rows, as the model's K and V
    got = stored(store_kv_triton, key, value, torch.int8)
    want = stored(store_kv_reference, key, value, torch.int8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the reference itself is the format: the tie row rounded half to even, the untouched slots poisoned
    k_rows = got[0].view(torch.int8).view(-1, kv_heads, kv_int8.row_dim(head_dim))
    gs = kv_int8.group_size(head_dim)
    half = torch.arange(gs) - gs // 2 + 0.5
    assert k_rows[0, 0, 1:gs].tolist() == torch.round(half[1:]).tolist()  # slot 0 holds token 1
    assert float(kv_int8.scales(k_rows[0, 0])[0]) == 0.5
    untouched = [s for s in range(16) if s not in (13, 0, 6, 7, 2, 9)]
    assert bool((got[0].view(-1, kv_heads, k_rows.shape[-1])[untouched] == 0x55).all())


def e4m3_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 value (subnormals included) and values past +-448, in two heads of 64 x 4 tokens."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = finite[finite.isfinite()]  # 254: NaN is 0x7f and 0xff
    beyond = torch.tensor([449.0, -449.0, 464.0, -465.0, 1e4, -3e38, 500.0, -448.5] * 2)
    values = torch.cat([finite, beyond, finite[:242]])  # 4 tokens x 2 heads x 64
    key = values.view(4, 2, 64).to(dtype)
    return key, key.flip(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_store_clamps_to_448_and_writes_torch_e4m3_bytes(dtype):
    key, value = e4m3_inputs(dtype)
    got = stored(store_kv_triton, key, value, FP8)
    want = stored(store_kv_reference, key, value, FP8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # torch's own cast of the clamped values: e4m3 values as they are, the rest saturated at +-448
    expected = key.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    k_cache = got[0].view(FP8).view(-1, 2, 64)
    assert torch.equal(k_cache[torch.tensor([13, 0, 6, 7])].view(torch.uint8), expected.view(torch.uint8))
    assert k_cache.float().abs().max() == FP8_MAX and not k_cache.float().isnan().any()


ATTENTION = [  # (pool dtype, query group, head_dim, block_size)
    (torch.int8, 4, 64, 8),
    (torch.int8, 1, 32, 16),
    (torch.int8, 3, 128, 16),
    (FP8, 4, 64, 16),
    (FP8, 8, 128, 8),
]


def quantized_case(context_lens, q_lens, pool_dtype, group, head_dim, block_size, seed):
    """The kernels' inputs with an 8-bit pool, and the same case over that pool dequantized (the reference's)."""
    kv_heads = 2 if group < 8 else 1
    case = make_case(context_lens, q_lens, heads=group * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float32, seed=seed, sharpness=4.0)  # fmt: skip
    if pool_dtype == torch.int8:
        k, v = kv_int8.quantize_rows(case.k_cache * 3), kv_int8.quantize_rows(case.v_cache)
        return (
            case,
            dataclasses.replace(case, k_cache=kv_int8.dequantize_rows(k), v_cache=kv_int8.dequantize_rows(v)),
            k,
            v,
        )
    k, v = case.k_cache.to(FP8), case.v_cache.to(FP8)  # unit scale, as the float tests (their 1e-5 assumes it)
    return case, dataclasses.replace(case, k_cache=k.float(), v_cache=v.float()), k, v


def pool_id(config) -> str:
    dtype, group, head_dim, block_size = config
    return f"{'int8' if dtype == torch.int8 else 'fp8'}-gqa{group}-d{head_dim}-bs{block_size}"


@pytest.mark.parametrize("config", ATTENTION, ids=pool_id)
def test_decode_reads_8bit_pools_as_float64_over_the_dequantized_pool(config):
    pool_dtype, group, head_dim, block_size = config
    # one token, ragged, long enough for three splits of 32, exact blocks
    case, reference, k, v = quantized_case([1, 13, 70, 2 * block_size], [1] * 4, *config, seed=head_dim + group)
    out = paged_decode_triton(case.q, k, v, case.block_tables, case.context_lens, case.scale,
                              num_splits=3, block_n=16, out=poisoned_like(case.q))  # fmt: skip
    assert_matches_naive(out, reference)


@pytest.mark.parametrize("config", ATTENTION, ids=pool_id)
def test_prefill_reads_8bit_pools_as_float64_over_the_dequantized_pool(config):
    pool_dtype, group, head_dim, block_size = config
    # a whole prompt, a chunk after a cached prefix, a decode row, a long ragged chunk
    case, reference, k, v = quantized_case([11, 29, 17, 45], [11, 9, 1, 21], *config, seed=3 * head_dim + group)
    out = paged_prefill_triton(case.q, k, v, case.block_tables, case.context_lens, case.query_start_loc,
                               case.scale, rows=16, block_n=16, out=poisoned_like(case.q))  # fmt: skip
    assert_matches_naive(out, reference)


def test_bf16_queries_over_an_int8_pool_match_within_bf16_tolerance():
    case, reference, k, v = quantized_case([5, 40], [1, 1], torch.int8, 4, 64, 16, seed=9)
    q = case.q.to(torch.bfloat16)
    out = paged_decode_triton(q, k, v, case.block_tables, case.context_lens, case.scale, num_splits=2, block_n=16)
    assert_matches_naive(out, dataclasses.replace(reference, q=q))


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_block_copies_move_8bit_blocks_byte_for_byte(dtype):
    g = torch.Generator().manual_seed(2)
    pool = torch.randint(0, 256, (2, 2, 9, 4, 2, 36), generator=g, dtype=torch.uint8)
    pool[pool == 0x7F] = 0  # e4m3 NaN bytes would not compare equal as floats; bytes are compared anyway
    pool = pool.view(dtype)
    ids = torch.tensor([7, 0, 3])
    buffer = gather_blocks_triton(pool, ids)
    assert torch.equal(buffer.view(torch.uint8), pool.view(torch.uint8)[:, :, ids])
    target = torch.zeros_like(pool)
    scatter_blocks_triton(target, torch.tensor([1, 8, 4]), buffer)
    assert torch.equal(target.view(torch.uint8)[:, :, [1, 8, 4]], pool.view(torch.uint8)[:, :, ids])
    assert not target.view(torch.uint8)[:, :, [0, 2, 3, 5, 6, 7]].any()
