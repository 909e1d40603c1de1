"""``x @ W^T`` for a weight kept as GGUF's raw Q8_0, Q4_0, Q4_1, Q4_K or Q6_K blocks on the device (Triton,
for CUDA; tests run it under the CPU interpreter).

The weight is its rows of blocks as the file stores them (engine/quant/weight.py: ``[out, row_bytes]``
uint8); a block holds 32 values of one input row, a K-quant super-block 256 (ggml's layouts,
kernels/cpu/quant_formats.h):

- Q8_0, 34 bytes: fp16 scale ``d``, then 32 int8 ``q``; value = ``d * q``.
- Q4_0, 18 bytes: fp16 ``d``, then 16 bytes of nibbles: value ``j`` < 16 is the low nibble of byte ``j``,
  value ``j`` >= 16 the high nibble of byte ``j - 16``; value = ``d * (nibble - 8)``.
- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, then nibbles as Q4_0; value = ``d * nibble + m``.
- Q4_K, 144 bytes per 256 values: fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit (scale, min) pairs
  (ggml's ``get_scale_min_k4``), then 128 bytes of nibbles: sub-block ``s`` (32 values) is the low
  (``s`` even) or high nibbles of bytes ``32 * (s // 2)`` on; value = ``d * scale_s * nibble - dmin * min_s``.
- Q6_K, 210 bytes per 256 values: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one
  per 16 values), fp16 ``d`` last; value = ``d * scale * (q - 32)`` (ggml's ``dequantize_row_q6_K`` order).
  Its scales change every 16 values, so it walks the input 16 at a time (``_q6_k_product``).

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of the output and walks the input one block (32 values) at
a time: ``tl.dot`` of the activations with the block's integers (exact in bf16/fp16: |q| <= 128), then
the block's scale applied to that partial sum in float32, as llama.cpp's CUDA kernels scale after an
integer dot. So the weight is never rounded to the activations' 8-bit (bf16) mantissa, and the only
rounding besides float32 accumulation is the min term (Q4_1, Q4_K) times ``sum(x)``. The weight's bytes
are read once per ``BLOCK_M`` rows of activations: a decode step (few rows) streams each byte once.
"""

from __future__ import annotations

import torch

from kernels.triton.triton_or_stub import tl, triton

# format -> (values per block, bytes per block, code the kernel branches on)
FORMATS = {"Q8_0": (32, 34, 0), "Q4_0": (32, 18, 1), "Q4_1": (32, 20, 2), "Q4_K": (256, 144, 3), "Q6_K": (256, 210, 4)}
QK = 32  # values per (sub-)block: the kernel's step along the input


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointer(s) ``ptr``, as float32 (0 where ``mask`` is false)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(base, sub, mask):
    """Q4_K sub-block ``sub``'s (d * scale, -dmin * min) for super-blocks at ``base`` (ggml's
    ``get_scale_min_k4`` over the 12 bytes at offset 4: 6-bit pairs, the last four split in nibbles)."""
    here = tl.load(base + 4 + sub, mask=mask, other=0).to(tl.int32)  # byte sub
    ahead = tl.load(base + 8 + sub, mask=mask, other=0).to(tl.int32)  # byte sub + 4
    behind = tl.load(base + 4 + tl.where(sub >= 4, sub - 4, 0), mask=mask, other=0).to(tl.int32)  # byte sub - 4
    scale = tl.where(sub < 4, here & 63, (ahead & 0xF) | ((behind >> 6) << 4))
    low = tl.where(sub < 4, ahead & 63, (ahead >> 4) | ((here >> 6) << 4))
    return _fp16_at(base, mask) * scale.to(tl.float32), -_fp16_at(base + 2, mask) * low.to(tl.float32)


@triton.jit
def _q6_k_product(x_ptr, w_rows, rows, row_ok, col_ok, K, stride_xm, acc, BLOCK_BYTES: tl.constexpr, UPCAST):
    """``acc`` plus x times Q6_K rows, 16 values (one int8 scale) at a time: its quants (-32..31) are exact
    in bf16/fp16; the scale ``d * sc`` (fp16 by int8) is exact in float32 and multiplies each partial dot."""
    h = tl.arange(0, 16)
    for group in range(0, K // 16):
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + group * 16 + h[None, :], mask=row_ok[:, None], other=0.0
        )  # [BLOCK_M, 16]
        base = w_rows + (group // 16) * BLOCK_BYTES  # [BLOCK_N] the super-block: ql[128] qh[64] sc[16] d
        g = group % 16  # the 16-value group in it
        half = g // 8  # which 128 values
        quarter = (g // 2) % 4  # which 32 of those
        at = (g % 2) * 16 + h  # [16] position within the 32
        ql = tl.load(base[None, :] + 64 * half + 32 * (quarter % 2) + at[:, None], mask=col_ok[None, :], other=0)
        qh = tl.load(base[None, :] + 128 + 32 * half + at[:, None], mask=col_ok[None, :], other=0)
        q = ((ql.to(tl.int16) >> (4 * (quarter // 2))) & 0xF) | (((qh.to(tl.int16) >> (2 * quarter)) & 3) << 4)
        q = (q - 32).to(tl.int16)  # [16, BLOCK_N]
        sc = tl.load(base + 192 + 8 * half + (g % 2) + 2 * quarter, mask=col_ok, other=0).to(tl.int16)
        sc = tl.where(sc >= 128, sc - 256, sc)  # the byte as int8
        scale = _fp16_at(base + 208, col_ok) * sc.to(tl.float32)
        if UPCAST:
            part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, q.to(x.dtype))
        acc += part * scale[None, :]
    return acc


@triton.jit
def quant_matmul_kernel(
    x_ptr,  # [M, K] activations, row stride stride_xm
    w_ptr,  # [N, ROW_BYTES] uint8 blocks
    bias_ptr,  # [N] or a dummy when HAS_BIAS is false
    out_ptr,  # [M, N] in the activations' dtype, row stride stride_om
    M,
    N,
    K,
    stride_xm,
    stride_om,
    ROW_BYTES,
    FORMAT: tl.constexpr,  # 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 operands and IEEE products (fp32 inputs; the interpreter cannot dot bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features = weight rows
    row_ok = rows < M
    col_ok = cols < N
    j = tl.arange(0, 32)  # value within a block
    w_rows = w_ptr + cols.to(tl.int64) * ROW_BYTES  # [BLOCK_N] start of each weight row
    if FORMAT == 0:
        q_off = j  # byte j holds value j
    else:
        q_off = j % 16  # byte j % 16 holds value j in its low (j < 16) or high (j >= 16) nibble
    shift = (j // 16) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FORMAT == 4:
        acc = _q6_k_product(x_ptr, w_rows, rows, row_ok, col_ok, K, stride_xm, acc, BLOCK_BYTES, UPCAST)
    else:
        for block in range(0, K // 32):
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_xm + block * 32 + j[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )  # [BLOCK_M, 32]
            if FORMAT == 3:
                base = w_rows + (block // 8) * BLOCK_BYTES  # [BLOCK_N] the super-block
                sub = block % 8
                raw = tl.load(base[None, :] + 16 + 32 * (sub // 2) + j[:, None], mask=col_ok[None, :], other=0)
                q = ((raw.to(tl.int16) >> ((sub % 2) * 4)) & 0xF).to(tl.int16)
                scale, low = _k4_scale_min(base, sub, col_ok)
            else:
                base = w_rows + block * BLOCK_BYTES  # [BLOCK_N]
                header = 4 if FORMAT == 2 else 2
                raw = tl.load(base[None, :] + header + q_off[:, None], mask=col_ok[None, :], other=0)  # [32, BLOCK_N]
                if FORMAT == 0:
                    q = raw.to(tl.int16)
                    q = tl.where(q >= 128, q - 256, q)  # the byte as int8
                else:
                    q = ((raw.to(tl.int16) >> shift[:, None]) & 0xF).to(tl.int16)
                    if FORMAT == 1:
                        q = q - 8
                scale = _fp16_at(base, col_ok)  # [BLOCK_N]
                if FORMAT == 2:
                    low = _fp16_at(base + 2, col_ok)  # Q4_1's min
                else:
                    low = scale  # no min term (unused below)
            if UPCAST:
                part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, q.to(x.dtype))  # integers up to 128 are exact in bf16 and fp16
            acc += part * scale[None, :]
            if FORMAT >= 2:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * low[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quant_matmul(x: torch.Tensor, rows: torch.Tensor, type_name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantized rows, bias)`` for x ``[M, K]`` (bf16, fp16 or fp32) and ``rows`` the weight's
    ``[N, K / 32 * block bytes]`` uint8 blocks on x's device; the result is ``[M, N]`` in x's dtype."""
    if type_name not in FORMATS:
        raise ValueError(f"no Triton kernel for {type_name}; kernels: {', '.join(FORMATS)}")
    per_block, block_bytes, code = FORMATS[type_name]
    if x.dim() != 2 or x.shape[1] % per_block:
        raise ValueError(f"{type_name} activations must be [rows, a multiple of {per_block}], got {list(x.shape)}")
    m, k = x.shape
    n = rows.shape[0]
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != k // per_block * block_bytes:
        want = f"[N, {k // per_block * block_bytes}] uint8"
        raise ValueError(f"{type_name} rows for {k} inputs are {want}, got {rows.dtype} {list(rows.shape)}")
    if rows.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"activations on {x.device}, weight on {rows.device}: one device for both")
    x = x.contiguous()
    rows = rows.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, triton.next_power_of_2(m)))  # tl.dot needs 16 rows at least
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    quant_matmul_kernel[grid](
        x,
        rows,
        out if bias is None else bias.contiguous(),
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        rows.shape[1],
        FORMAT=code,
        BLOCK_BYTES=block_bytes,
        HAS_BIAS=bias is not None,
        UPCAST=x.dtype == torch.float32 or not x.is_cuda,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out
