"""The C prefill-attention kernel (kernels/cpu/prefill.c): against the naive float64 attention of
test_kernel_attention for every query group and head size it has a copy for, through the engine's plan,
in every vector width and without OpenMP; first chunks, later chunks over a cached prefix, several
requests in one step and prefill rows beside decode rows (how the engine chooses it:
test_kernel_cpu_decode.py)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.triton.paged_prefill import NativePrefill
from tests.test_kernel_attention import assert_matches_naive, kernel_case, make_case, on_one_thread_and_two


def run_native(lib, case) -> torch.Tensor:
    plan = kernels.plan_attention(
        case.block_tables, case.context_lens, case.query_start_loc, case.k_cache, lib, native_prefill=lib
    )
    assert isinstance(plan.native_prefill, NativePrefill)
    return kernels.paged_attention(*case.args(), plan=plan)


# (context, chunk) per request: a one-token prompt; chunks one short of, at and one past a 16-query
# tile; a first chunk past one 64-key tile; later chunks over a cached prefix, one of a single query
# beside a longer one (a one-query chunk counts as decode only where every row in the step is one).
REQUESTS = [(1, 1), (15, 15), (16, 16), (17, 17), (150, 150), (100, 37), (300, 64), (81, 1), (70, 33)]


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
def test_c_prefill_matches_naive(any_build, group, head_dim, block_size):
    case = kernel_case([ctx for ctx, _ in REQUESTS], [q for _, q in REQUESTS], group, head_dim, block_size)
    assert_matches_naive(run_native(any_build, case), case)


def test_c_prefill_in_a_mixed_step_matches_naive(any_build):
    """Decode rows by the decode kernel, prefill rows by this one, each put back on its own token."""
    q_lens = [1, 6, 1, 1, 40, 1]
    case = make_case(
        [9, 30, 1, 64, 45, 17], q_lens, heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=4
    )
    plan = kernels.plan_attention(
        case.block_tables, case.context_lens, case.query_start_loc, case.k_cache, any_build, any_build
    )
    assert plan.native_prefill is not None and plan.native_prefill.context_lens.tolist() == [30, 45]
    assert_matches_naive(kernels.paged_attention(*case.args(), plan=plan), case)


def test_c_prefill_gives_the_same_bits_on_one_thread_and_two(library):
    case = make_case([700, 90, 129], [700, 90, 64], heads=8, kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32, seed=9)  # fmt: skip
    one, two = on_one_thread_and_two(lambda: run_native(library, case))
    assert torch.equal(one, two)  # each (request, kv head, query tile) is one thread's work, in one order
    assert_matches_naive(two, case)


def test_a_block_id_outside_the_pool_is_refused_before_the_kernel_reads(library):
    case = make_case([20, 9], [20, 4], heads=4, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=6)
    case.block_tables[1, 0] = case.k_cache.shape[0]  # one past the last block
    with pytest.raises(IndexError, match=f"pool has {case.k_cache.shape[0]} blocks"):
        run_native(library, case)
