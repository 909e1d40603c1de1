"""The batched LoRA product (kernels/triton/lora_batched.py): the Triton kernel (CPU interpreter here) against
its torch reference, and that reference against an independent per-token float64 computation, on mixed
batches: base tokens, three adapters of ranks 4, 8 and 16 with different scalings, fused slices that
some adapters leave alone. Weights outside each slot's column ranges are NaN, so reading one shows.

Tolerances are relative to each output's magnitude, ``|y| + |scaling| * sum_j |s_j| |B_oj|`` (the
sum the error analysis of a dot product is bounded by), so a value that cancels to near zero is held
to the accuracy of its terms. Kernel and reference round at the same points (float32 accumulation, the
shrink rounded to the weights' dtype, one rounding of y): float32 differs by summation order (1e-5);
float16 by at most a rounding at each of the two points (2e-3 > 2 * 2^-11). bfloat16 gets 2e-2: under
the interpreter a cast to bfloat16 truncates (numpy has no bfloat16), one full unit of 2^-7 at each
of the two points; on CUDA it rounds (tests/gpu holds it to 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton.lora_batched import LoRAWeights, lora_delta_reference, lora_delta_triton, plan_lora_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HIDDEN = 96  # not a multiple of the kernel's 64-column K step
SLICES = (48, 16, 16)  # q, k, v of a fused projection
RANKS = [[4, 0, 4], [8, 8, 8], [16, 16, 0]]  # slot -> rank per slice; 0: the slot leaves that slice alone
SCALINGS = [2.0, 0.5, 1.25]


def make_weights(
    dtype: torch.dtype,
    seed: int = 0,
    hidden: int = HIDDEN,
    slices: tuple[int, ...] = SLICES,
    ranks: list[list[int]] = RANKS,
    scalings: list[float] = SCALINGS,
    device: str = "cpu",
) -> LoRAWeights:
    """Each slot's slices take consecutive shrink columns (as the engine's fused A/B do); all else is NaN."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    for width in slices:
        offsets.append(offsets[-1] + width)
    num_slots, rows = len(ranks), max(sum(r) for r in ranks)
    a = torch.full((num_slots, rows, hidden), float("nan"))
    b = torch.full((num_slots, offsets[-1], rows), float("nan"))
    cols = [[0] * len(slices) for _ in ranks]
    for s, slot_ranks in enumerate(ranks):
        col = 0
        for p, r in enumerate(slot_ranks):
            cols[s][p] = col
            a[s, col : col + r] = torch.randn(r, hidden, generator=gen) / hidden**0.5
            b[s, offsets[p] : offsets[p + 1], col : col + r] = torch.randn(slices[p], r, generator=gen) / r**0.5
            col += r
    return LoRAWeights(
        a.to(device, dtype),
        b.to(device, dtype),
        torch.tensor(cols, dtype=torch.int32, device=device),
        torch.tensor(ranks, dtype=torch.int32, device=device),
        torch.tensor(scalings, device=device),
        tuple(offsets),
        max_rank=max(max(r) for r in ranks),
    )


def mixed_slots(num_tokens: int, seed: int) -> torch.Tensor:
    """Base (-1) and every slot, shuffled; slot 1 gets a run longer than one 16-token tile."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.cat([torch.full((20,), 1), torch.randint(-1, len(RANKS), (num_tokens - 20,), generator=gen)])
    return slots[torch.randperm(num_tokens, generator=gen)]


def per_token_float64(x, y, weights: LoRAWeights, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent of both implementations: one token at a time, float64, straight from the definition.
    Returns (y + delta, the magnitude each output's rounding errors are relative to)."""
    out, magnitude = y.double().clone(), y.double().abs()
    cols, ranks, scalings = weights.cols.tolist(), weights.ranks.tolist(), weights.scalings.tolist()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for p in range(len(weights.slice_offsets) - 1):
            c, r = cols[s][p], ranks[s][p]
            lo, hi = weights.slice_offsets[p], weights.slice_offsets[p + 1]
            if r:
                shrink = weights.a[s, c : c + r].double() @ x[t].double()  # [r]
                b = weights.b[s, lo:hi, c : c + r].double()
                out[t, lo:hi] += scalings[s] * (b @ shrink)
                magnitude[t, lo:hi] += abs(scalings[s]) * (b.abs() @ shrink.abs())
    return out, magnitude


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, tol: float):
    error = (actual.double() - expected.double()).abs()
    worst = (error / magnitude).max().item()
    assert (error <= tol * magnitude).all(), f"error {worst:.2e} of magnitude, allowed {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 45])  # one decode token; a mixed step with a prefill run
def test_kernel_equals_reference_and_leaves_base_rows_alone(dtype, num_tokens):
    check_kernel_against_reference(make_weights(dtype), mixed_slots(max(num_tokens, 21), seed=num_tokens)[:num_tokens])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_at_ranks_above_one_tile(dtype):
    """Ranks 72 and 80 in one slot (152 shrink rows: three 64-row shrink tiles, two expand steps)
    beside slots of ranks 4 and 8."""
    weights = make_weights(dtype, 4, ranks=[[80, 0, 72], [4, 4, 4], [8, 8, 8]], scalings=[0.25, 3.0, 1.0])
    check_kernel_against_reference(weights, mixed_slots(40, seed=9))


def check_kernel_against_reference(weights: LoRAWeights, slots: torch.Tensor) -> None:
    dtype, num_tokens = weights.a.dtype, len(slots)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, weights.slice_offsets[-1], generator=gen).to(dtype)
    y_kernel, y_reference = y0.clone(), y0.clone()

    lora_delta_triton(x, y_kernel, weights, plan_lora_batch(slots, weights.num_slots))
    lora_delta_reference(x, y_reference, weights, slots)

    _, magnitude = per_token_float64(x, y0, weights, slots)
    assert_close_relative(y_kernel, y_reference, magnitude, TOLERANCE[dtype])
    assert torch.equal(y_kernel[slots < 0], y0[slots < 0])  # base rows: bit for bit untouched
    assert not y_kernel.isnan().any()  # no NaN weight outside a slot's ranges was read
    changed = (y_kernel != y0).any(1)
    assert changed[slots >= 0].all()  # every adapter row got its delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_float64_definition(dtype):
    weights = make_weights(dtype, seed=3)
    slots = mixed_slots(40, seed=5)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, HIDDEN, generator=gen).to(dtype)
    y = torch.randn(40, weights.slice_offsets[-1], generator=gen).to(dtype)
    expected, magnitude = per_token_float64(x, y, weights, slots)
    lora_delta_reference(x, y, weights, slots)
    # rounding to nearest at the shrink and at y: 2 half-units of the dtype (2^-8 for bfloat16)
    assert_close_relative(y, expected, magnitude, {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8}[dtype])


def test_plan_orders_tokens_by_slot_keeping_their_order():
    slots = torch.tensor([1, -1, 0, 1, 2, -1, 0, 1])
    batch = plan_lora_batch(slots, num_slots=4)  # slot 3 has no tokens
    assert batch.sorted_tokens.tolist() == [1, 5, 2, 6, 0, 3, 7, 4]
    assert batch.seg_start.tolist() == [2, 4, 7, 8] and batch.seg_len.tolist() == [2, 3, 1, 0]
