"""Tile steps shared by the decode and chunked-prefill attention kernels (Triton device functions).

A KV tile is BLOCK_N consecutive token positions of one request, which may span several pages; each
token's page comes from the block table, so the tile is a gather of ``[BLOCK_N, head_dim]`` rows of one
KV head. The softmax is online and in base 2 (scores pre-multiplied by scale * log2(e)).
"""

from __future__ import annotations

from kernels.triton.triton_or_stub import tl, triton


@triton.jit
def load_kv_tile(
    k_ptr,
    v_ptr,
    table_ptr,  # table_ptr: this request's row of the block table
    t,
    t_ok,
    d,
    d_ok,
    kv_head,  # t: [BLOCK_N] token positions, d: [DIM_PAD] feature indices
    stride_table,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    page = tl.load(table_ptr + (t // PAGE_SIZE) * stride_table, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE_SIZE
    mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=mask,
        other=0.0,
    )  # [BLOCK_N, DIM_PAD]
    v = tl.load(
        v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """q: [ROWS, D]; k, v: [BLOCK_N, D]; visible: [ROWS, BLOCK_N]. Returns the updated (m_i, l_i, acc).

    m_i starts at a finite -1e30 rather than -inf so a row with nothing visible yet stays NaN-free.
    """
    if UPCAST:  # fp32 inputs get full fp32 products (no TF32); the interpreter cannot dot bf16
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
