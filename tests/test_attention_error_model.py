"""The float32 attention error model (tests/attention_error_model.py) checked on the CPU kernel:
its worst element is within the bound, and the bound is not loose (within 4x of what happens)."""

from __future__ import annotations

import torch

import kernels
from tests.attention_error_model import fp32_atol, key_counts, worst_ratio
from tests.gpu.test_gpu_kernels import per_request_attention
from tests.test_kernel_attention import make_case

# The GPU test's prefill case (chunks with and without a prefix, n up to 2048), at 16/16 heads of 64.
Q_LENS = [512, 1, 77, 300, 1, 129, 1000, 3]
CONTEXT_LENS = [q + prefix for q, prefix in zip(Q_LENS, [0, 900, 1500, 33, 2047, 0, 1, 640])]


def test_key_counts_are_causal_positions():
    assert key_counts([2, 1], [5, 3]).tolist() == [4.0, 5.0, 3.0]


def test_cpu_fp32_prefill_within_the_model_and_the_model_tight():
    case = make_case(CONTEXT_LENS, Q_LENS, heads=16, kv_heads=16, head_dim=64, block_size=16,
                     dtype=torch.float32, seed=16, sharpness=4.0)  # fmt: skip
    exact = per_request_attention(case)
    out = kernels.paged_attention(*case.args())
    ratio = worst_ratio(out, exact, fp32_atol(case, Q_LENS, CONTEXT_LENS))
    # Within the C=2 bound, and reaching at least a quarter of the C=1 bound (measured: 0.68 of it).
    assert 0.25 / 2 <= ratio <= 1.0, ratio
