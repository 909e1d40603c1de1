"""The batched LoRA product of one step: tokens of different adapters (and of the base model) in one
launch per projection, in the shape punica, vLLM and SGLang use.

    shrink:  s[t]           = x[t] @ A[slot[t]]^T                                   [T, R]
    expand:  y[t, slice p] += scaling[slot[t]] * s[t, cols p] @ B[slot[t], slice p]^T

``slot[t] == -1`` is the base model: its row of ``y`` is not touched. A fused projection (q/k/v,
gate/up) has several output slices; slice p of slot s reads ``ranks[s, p]`` shrink columns starting at
``cols[s, p]`` (rank 0: the adapter leaves that slice alone), so adapters of different ranks share one
stack padded to the largest, and weights outside a slot's column ranges are never read.

Grouping: segments, as SGMV and vLLM's v1 kernels do, not one program per token (BGMV). The step's
token indices are sorted by slot once (``plan_lora_batch``, on the device: no host sync) and every
module of the step reuses that order; a program takes BLOCK_M tokens of one slot's segment and
multiplies them with ``tl.dot``, so a prefill chunk of hundreds of tokens reads its adapter's weights
once per tile instead of once per token, and a decode batch of mixed adapters is the same code with
short segments. The grid covers ``cdiv(T, BLOCK_M)`` tiles for every slot (the most any slot can
have); the tiles past a slot's segment return at once. Ranks are tiled too (64 columns a shrink
program, 64 a step of the expand's loop), so a high max rank costs programs, not registers.

The torch reference computes the same rounding points (float32 accumulation, the shrink rounded to
the weights' dtype before the expand, one rounding of y), one slot and slice at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton.triton_or_stub import tl, triton

_BLOCK_M = 16  # tokens per tile (tl.dot needs >= 16)
_BLOCK_K = 64  # hidden columns per shrink step
_BLOCK_N = 64  # output columns per expand tile
_MAX_BLOCK_R = 64  # rank columns per tile: a higher rank takes more shrink programs / expand steps, not registers


@dataclass(slots=True)
class LoRAWeights:
    """One (fused) projection's adapters, stacked by slot."""

    a: torch.Tensor  # [S, R, H] shrink rows of each slot, padded to the largest R
    b: torch.Tensor  # [S, O, R] expand weights; row o of slice p reads columns cols[s,p] .. +ranks[s,p]
    cols: torch.Tensor  # [S, P] int32, on a's device
    ranks: torch.Tensor  # [S, P] int32, 0: slot s leaves slice p alone
    scalings: torch.Tensor  # [S] float32
    slice_offsets: tuple[int, ...]  # P + 1 output columns: slice p is y[:, offsets[p] : offsets[p + 1]]
    max_rank: int  # the largest entry of ranks (sizes the expand tile)
    offsets_tensor: torch.Tensor | None = None  # slice_offsets on the device, made once

    def __post_init__(self) -> None:
        num_slots, num_slices = len(self.a), len(self.slice_offsets) - 1
        assert self.b.shape == (num_slots, self.slice_offsets[-1], self.a.shape[1]), (self.a.shape, self.b.shape)
        assert self.cols.shape == self.ranks.shape == (num_slots, num_slices), (self.cols.shape, self.ranks.shape)
        assert self.scalings.shape == (num_slots,) and self.a.dtype == self.b.dtype
        if self.offsets_tensor is None:
            self.offsets_tensor = torch.tensor(self.slice_offsets, dtype=torch.int32, device=self.a.device)

    @property
    def num_slots(self) -> int:
        return len(self.a)


@dataclass(slots=True)
class LoRABatch:
    """One step's token rows grouped by slot; made once, read by every projection of the step."""

    slots: torch.Tensor  # [T] int32, -1: base model
    sorted_tokens: torch.Tensor  # [T] int32: the base tokens, then slot 0's, slot 1's, ...
    seg_start: torch.Tensor  # [S] int32: where slot s's tokens start in sorted_tokens
    seg_len: torch.Tensor  # [S] int32


def plan_lora_batch(slots: torch.Tensor, num_slots: int) -> LoRABatch:
    """Sort and binary search only: no host sync on CUDA (``torch.bincount`` would read the maximum back)."""
    slots = slots.to(torch.int32)
    sorted_slots, order = torch.sort(slots, stable=True)
    each = torch.arange(num_slots, dtype=torch.int32, device=slots.device)
    starts = torch.searchsorted(sorted_slots, each).to(torch.int32)
    ends = torch.searchsorted(sorted_slots, each, right=True).to(torch.int32)
    return LoRABatch(slots, order.to(torch.int32), starts, ends - starts)


def lora_delta_reference(x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, slots: torch.Tensor) -> None:
    """``y += delta`` in place, one slot and slice at a time."""
    cols, ranks, offsets = weights.cols.tolist(), weights.ranks.tolist(), weights.slice_offsets
    for s in range(weights.num_slots):
        rows = (slots == s).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        for p in range(len(offsets) - 1):
            c, r, lo, hi = cols[s][p], ranks[s][p], offsets[p], offsets[p + 1]
            if r == 0:
                continue
            shrink = (x[rows].float() @ weights.a[s, c : c + r].float().T).to(weights.a.dtype)  # [rows, r]
            delta = (shrink.float() @ weights.b[s, lo:hi, c : c + r].float().T) * weights.scalings[s].float()
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)


@triton.jit
def _tile_tokens(sorted_ptr, seg_start_ptr, seg_len_ptr, slot, m_tile, BLOCK_M: tl.constexpr):
    """The tokens of tile ``m_tile`` of ``slot``'s segment: (token indices [BLOCK_M] int64, valid mask)."""
    seg_len = tl.load(seg_len_ptr + slot)
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = m < seg_len
    tokens = tl.load(sorted_ptr + tl.load(seg_start_ptr + slot) + m, mask=valid, other=0).to(tl.int64)
    return tokens, valid


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    shrink_ptr,
    sorted_ptr,
    seg_start_ptr,
    seg_len_ptr,
    cols_ptr,
    ranks_ptr,
    hidden,
    stride_xt,  # x: [T, H], H contiguous
    stride_as,
    stride_ar,
    stride_ah,  # a: [S, R, H]
    stride_st,  # shrink: [T, r_tiles * BLOCK_R] float32, contiguous
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m_tile = tl.program_id(0)
    slot = tl.program_id(1)
    r_tile = tl.program_id(2)
    end = 0  # shrink rows this slot's slices read: up to the end of its last column range
    for p in tl.static_range(NUM_SLICES):
        rank = tl.load(ranks_ptr + slot * NUM_SLICES + p)
        end = tl.maximum(end, tl.where(rank > 0, tl.load(cols_ptr + slot * NUM_SLICES + p) + rank, 0))
    if (m_tile * BLOCK_M >= tl.load(seg_len_ptr + slot)) | (r_tile * BLOCK_R >= end):
        return
    tokens, valid = _tile_tokens(sorted_ptr, seg_start_ptr, seg_len_ptr, slot, m_tile, BLOCK_M)
    r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < end
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a_tile = a_base + r[:, None] * stride_ar + k[None, :] * stride_ah
        a = tl.load(a_tile, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # fp32 inputs get full fp32 products (no TF32); the interpreter cannot dot bf16
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    tl.store(shrink_ptr + tokens[:, None] * stride_st + r[None, :], acc, mask=valid[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    shrink_ptr,
    b_ptr,
    y_ptr,
    sorted_ptr,
    seg_start_ptr,
    seg_len_ptr,
    cols_ptr,
    ranks_ptr,
    offsets_ptr,
    scalings_ptr,
    stride_st,  # shrink: [T, >= R] float32
    stride_bs,
    stride_bo,
    stride_br,  # b: [S, O, R]
    stride_yt,  # y: [T, O], O contiguous
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m_tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    slot = tl.program_id(2) // NUM_SLICES
    part = tl.program_id(2) % NUM_SLICES
    rank = tl.load(ranks_ptr + slot * NUM_SLICES + part)
    out_start = tl.load(offsets_ptr + part)
    width = tl.load(offsets_ptr + part + 1) - out_start
    if (m_tile * BLOCK_M >= tl.load(seg_len_ptr + slot)) | (rank == 0) | (n_tile * BLOCK_N >= width):
        return
    tokens, valid = _tile_tokens(sorted_ptr, seg_start_ptr, seg_len_ptr, slot, m_tile, BLOCK_M)
    first_col = tl.load(cols_ptr + slot * NUM_SLICES + part)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    out = out_start + n  # [BLOCK_N] columns of y
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + out[None, :] * stride_bo
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, rank, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_ok = j < rank
        col = first_col + j  # [BLOCK_R] shrink (and B) columns
        s_tile = shrink_ptr + tokens[:, None] * stride_st + col[None, :]
        s = tl.load(s_tile, mask=valid[:, None] & j_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
        b = tl.load(b_base + col[:, None] * stride_br, mask=j_ok[:, None] & n_ok[None, :], other=0.0)
        s = s.to(b.dtype)  # rounded to the weights' dtype, as a torch matmul in that dtype would
        if UPCAST:
            delta += tl.dot(s.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            delta += tl.dot(s, b)
    delta = delta * tl.load(scalings_ptr + slot)
    y_tile = y_ptr + tokens[:, None] * stride_yt + out[None, :]
    mask = valid[:, None] & n_ok[None, :]
    # each (token, column) belongs to one slot and one slice, hence to one program: no atomics
    y = tl.load(y_tile, mask=mask)
    tl.store(y_tile, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, batch: LoRABatch) -> None:
    """``y += delta`` in place (``x``: [T, H]; ``y``: [T, O] with contiguous rows)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    num_tokens, hidden = x.shape
    a, b = weights.a, weights.b
    assert y.shape == (num_tokens, weights.slice_offsets[-1]) and a.shape[2] == hidden, (x.shape, y.shape, a.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and x.dtype == a.dtype, (x.stride(), y.stride(), x.dtype, a.dtype)
    assert batch.slots.shape == (num_tokens,) and batch.seg_len.shape == (weights.num_slots,)
    if num_tokens == 0 or weights.max_rank == 0:
        return
    num_slices = len(weights.slice_offsets) - 1
    upcast = x.dtype == torch.float32 or not x.is_cuda  # the CPU interpreter cannot dot bf16
    shrink_block_r = min(_MAX_BLOCK_R, max(16, triton.next_power_of_2(a.shape[1])))
    r_tiles = triton.cdiv(a.shape[1], shrink_block_r)
    shrink = torch.empty((num_tokens, r_tiles * shrink_block_r), dtype=torch.float32, device=x.device)
    m_tiles = triton.cdiv(num_tokens, _BLOCK_M)
    _lora_shrink_kernel[(m_tiles, weights.num_slots, r_tiles)](
        x, a, shrink, batch.sorted_tokens, batch.seg_start, batch.seg_len, weights.cols, weights.ranks,
        hidden, x.stride(0), a.stride(0), a.stride(1), a.stride(2), shrink.stride(0),
        NUM_SLICES=num_slices, BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=shrink_block_r, UPCAST=upcast,
    )  # fmt: skip
    widest = max(hi - lo for lo, hi in zip(weights.slice_offsets, weights.slice_offsets[1:]))
    grid = (m_tiles, triton.cdiv(widest, _BLOCK_N), weights.num_slots * num_slices)
    _lora_expand_kernel[grid](
        shrink, b, y, batch.sorted_tokens, batch.seg_start, batch.seg_len, weights.cols, weights.ranks,
        weights.offsets_tensor, weights.scalings,
        shrink.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
        NUM_SLICES=num_slices, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_R=min(_MAX_BLOCK_R, max(16, triton.next_power_of_2(weights.max_rank))), UPCAST=upcast,
    )  # fmt: skip
