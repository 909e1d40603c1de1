"""Paged attention: Triton decode and chunked-prefill kernels (under the CPU interpreter here) and the
batched torch reference (the engine's CPU path), each against a naive per-request float64 computation.

Shapes are small and irregular: context lengths that are not multiples of the block size, permuted
block ids in a non-contiguous block table, queries sliced out of a fused QKV tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import kernels
from kernels.triton.paged_attention import paged_attention_reference, paged_attention_triton
from kernels.triton.paged_decode import bucket_sizes, paged_decode_reference, paged_decode_triton
from kernels.triton.paged_prefill import paged_prefill_reference, paged_prefill_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass(slots=True)
class AttentionCase:
    q: torch.Tensor  # [num_tokens, heads, d], a strided view of a fused QKV tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32, non-contiguous (column stride 2)
    context_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    scale: float

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
            self.scale,
        )


def make_case(context_lens, q_lens, *, heads, kv_heads, head_dim, block_size, dtype, seed, device="cpu", sharpness=1.0):
    """Fresh random inputs; request i's blocks are a random permutation of the pool's ids.
    ``sharpness`` multiplies the softmax scale: peaky attention over long contexts keeps outputs O(1)
    instead of averaging them towards 0, where an absolute tolerance would hide wrong keys."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens) + 1  # one spare column of padding
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    ids = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    wide = torch.zeros(batch, 2 * max_blocks, dtype=torch.int32, device=device)
    block_tables = wide[:, ::2]  # stride (2 * max_blocks, 2): exercises the explicit strides
    block_tables.copy_(ids)
    num_tokens = sum(q_lens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # strided like the model's q
    loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    context = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return AttentionCase(q, k_cache, v_cache, block_tables, context, loc, sharpness * head_dim**-0.5)


def kernel_case(context_lens, q_lens, group: int, head_dim: int, block_size: int) -> AttentionCase:
    """A float32 case for the C kernels at one query group and head size: two KV heads (one at group 8),
    peaky attention, q strided like the rows of the model's fused QKV tensor."""
    kv_heads = 2 if group < 8 else 1
    case = make_case(context_lens, q_lens, heads=group * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float32, seed=group * head_dim + block_size, sharpness=4.0)  # fmt: skip
    assert case.q.stride(0) != case.q.shape[1] * head_dim
    return case


def on_one_thread_and_two(run) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` with torch (and so the C kernels) on one thread, then on two; torch's count restored."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(threads)


def naive_attention(case: AttentionCase) -> torch.Tensor:
    """One request and one head at a time, float64, keys walked block by block through the table."""
    q, k_cache, v_cache = case.q.cpu().double(), case.k_cache.cpu().double(), case.v_cache.cpu().double()
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for i, ctx in enumerate(case.context_lens.tolist()):
        start, end = case.query_start_loc[i].item(), case.query_start_loc[i + 1].item()
        table = case.block_tables[i].tolist()
        keys = torch.cat([k_cache[table[j]] for j in range(-(-ctx // block_size))])[:ctx]  # [ctx, kvh, d]
        values = torch.cat([v_cache[table[j]] for j in range(-(-ctx // block_size))])[:ctx]
        for j, token in enumerate(range(start, end)):
            pos = ctx - (end - start) + j  # this query's absolute position
            for h in range(q.shape[1]):
                scores = keys[: pos + 1, h // group] @ q[token, h] * case.scale  # [pos + 1]
                out[token, h] = scores.softmax(0) @ values[: pos + 1, h // group]
    return out


def assert_matches_naive(out: torch.Tensor, case: AttentionCase) -> None:
    tol = TOLERANCE[case.q.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.cpu().double(), naive_attention(case), rtol=tol, atol=tol)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


# Every GQA ratio (1, 4, 8) x head dim (64, 128) x block size (8, 16) in fp32; half precision on a few.
SHAPES = [(group, head_dim, block_size) for group in (1, 4, 8) for head_dim in (64, 128) for block_size in (8, 16)]
HALF = [
    (torch.bfloat16, 4, 128, 16),
    (torch.bfloat16, 8, 64, 8),
    (torch.float16, 1, 64, 16),
    (torch.float16, 8, 128, 8),
]
CONFIGS = [(torch.float32, *shape) for shape in SHAPES] + HALF


def config_id(config) -> str:
    dtype, group, head_dim, block_size = config
    return f"{str(dtype).removeprefix('torch.')}-gqa{group}-d{head_dim}-bs{block_size}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_decode_kernel_matches_naive(config):
    dtype, group, head_dim, block_size = config
    kv_heads = 2 if group < 8 else 1
    num_splits = 1 + (group + head_dim // 64 + block_size // 8) % 4  # 1..4 splits across the configs
    context_lens = [1, 13, 70, 2 * block_size]  # a single token, ragged, long enough to split, exact blocks
    case = make_case(
        context_lens,
        [1] * 4,
        heads=group * kv_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group * head_dim + block_size,
    )
    out = paged_decode_triton(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        case.scale,
        num_splits=num_splits,
        block_n=16,
        out=poisoned_like(case.q),
    )
    assert_matches_naive(out, case)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_prefill_kernel_matches_naive(config):
    dtype, group, head_dim, block_size = config
    kv_heads = 2 if group < 8 else 1
    # whole prompt (ctx == q_len), a chunk after a cached prefix, a decode row, a long ragged chunk
    context_lens, q_lens = [11, 29, 17, 45], [11, 9, 1, 21]
    case = make_case(
        context_lens,
        q_lens,
        heads=group * kv_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=3 * group * head_dim + block_size,
    )
    out = paged_prefill_triton(*case.args(), rows=16, block_n=16, out=poisoned_like(case.q))
    assert_matches_naive(out, case)


def test_triton_dispatch_picks_decode_or_prefill_kernel():
    common = dict(heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=7)
    decode = make_case([5, 19, 33], [1, 1, 1], **common)
    assert_matches_naive(paged_attention_triton(*decode.args()), decode)
    mixed = make_case([5, 19, 33], [1, 4, 1], **common)
    assert_matches_naive(paged_attention_triton(*mixed.args()), mixed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens", [[1, 1, 1, 1, 1], [7, 3, 12, 1, 5], [1, 6, 1, 1, 20]], ids=["decode", "prefill", "mixed"]
)
def test_kernel_reference_cpu_path_matches_naive(dtype, q_lens):
    """The public function on CPU (the engine's path) splits decode and prefill rows; check both halves."""
    context_lens = [q + extra for q, extra in zip(q_lens, [0, 9, 30, 4, 17])]
    case = make_case(context_lens, q_lens, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=11)
    assert_matches_naive(kernels.paged_attention(*case.args()), case)


def test_kernel_reference_halves_match_naive():
    """The decode and prefill references on their own (each is also a kernel's reference on GPU)."""
    common = dict(heads=12, kv_heads=3, head_dim=64, block_size=8, dtype=torch.float32, seed=5)
    decode = make_case([3, 8, 27], [1, 1, 1], **common)
    out = paged_decode_reference(
        decode.q, decode.k_cache, decode.v_cache, decode.block_tables, decode.context_lens, decode.scale
    )
    assert_matches_naive(out, decode)
    prefill = make_case([3, 8, 27], [3, 2, 10], **common)
    assert_matches_naive(paged_prefill_reference(*prefill.args()), prefill)
    assert_matches_naive(paged_attention_reference(*prefill.args()), prefill)


def test_kernel_reference_decode_buckets_by_length_match_naive():
    """With several buckets the CPU path sorts requests by context length into them: the unsorted,
    permuted result must still land on each request's own row."""
    lengths = torch.randint(1, 90, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    case = make_case(
        lengths, [1] * len(lengths), heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=17
    )
    assert_matches_naive(kernels.paged_attention(*case.args()), case)


def test_decode_buckets_keep_their_padded_kv_within_the_byte_budget():
    # 1 KiB of K+V a token: a bucket of r rows padded to length n holds r * n KiB, at most 2 MiB = 2048 KiB.
    lens = [100] * 5 + [500] * 5 + [3000]
    assert bucket_sizes(lens, 1024) == [5, 4, 1, 1]  # 6 x 500 and 5 x 500 overflow; 3000 alone overflows too
    assert bucket_sizes([10] * 20, 1024) == [16, 4]  # short contexts: the row cap
    assert bucket_sizes([7], 1 << 30) == [1]
    # The plan follows them: sorted rows, each bucket padded to its own longest context.
    case = make_case(
        [500, 100, 3000, 100, 500],
        [1] * 5,
        heads=8,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )  # 2 KV heads x 64 x 4 bytes x (K, V) = 1 KiB a token
    plan = kernels.plan_attention(case.block_tables, case.context_lens, case.query_start_loc, case.k_cache)
    assert [(sorted(b.rows.tolist()), b.max_ctx) for b in plan.decode] == [([0, 1, 3, 4], 500), ([2], 3000)]
    assert_matches_naive(kernels.paged_attention(*case.args(), plan=plan), case)


def test_plan_made_once_serves_every_layer_of_a_mixed_step():
    """The runner plans a step once (plan_attention) and every layer reuses the plan: decode requests
    bucketed shortest first (16 rows at most), prefill requests repacked; each layer's caches differ."""
    q_lens = [1] * 20 + [5, 1, 7]
    lengths = torch.randint(1, 70, (23,), generator=torch.Generator().manual_seed(8)).tolist()
    lengths = [max(n, q) for n, q in zip(lengths, q_lens)]
    first, other = (
        make_case(lengths, q_lens, heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=seed)
        for seed in (1, 2)
    )
    layers = [first, dataclasses.replace(first, q=other.q, k_cache=other.k_cache, v_cache=other.v_cache)]
    plan = kernels.plan_attention(first.block_tables, first.context_lens, first.query_start_loc, first.k_cache)
    decode_lens = [n for n, q in zip(lengths, q_lens) if q == 1]
    assert [len(b.rows) for b in plan.decode] == [16, 5]  # 16 rows of < 70 tokens: 1.1 MB of K+V, in budget
    assert [b.max_ctx for b in plan.decode] == [sorted(decode_lens)[15], max(decode_lens)]
    assert plan.decode_tokens.tolist() == [i for i in range(20)] + [25]  # token index of each decode row
    assert plan.prefill.tokens.tolist() == [20, 21, 22, 23, 24] + [26, 27, 28, 29, 30, 31, 32]
    for case in layers:
        assert_matches_naive(kernels.paged_attention(*case.args(), plan=plan), case)
