"""``x @ W^T`` on CPU for a decode step's few rows, in the form MKL runs fastest (torch 2.13, fp32).

The plain product ``[rows, in] x [in, out]`` with few rows leaves MKL little to split across threads
and runs well below its rate; the transposed ``W @ x^T`` splits the long ``out`` side instead.
Measured (interleaved A/B of whole decode steps of the ``small`` model, against ``F.linear``):

- layer projections, two threads: -15% per step at batch 8, -10% at 64; one thread: -1.5% at batch
  16, inside that A/B's noise (not worth it); a 2,048-token prefill step: +31% (so only up to ``FEW_ROWS``);
- LM head (32,000 x 512), also sliced by 1,024 vocab rows: -17% at batch 4 and -6% at 16 on one
  thread, -10% at 8 and -6% at 64 on two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 64  # up to this many rows the transposed form wins (it loses from ~96 on)
LM_HEAD_SLICE_ROWS = 1024  # weight rows per matmul in the sliced form


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, slice_rows: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` computed as ``(weight @ x^T)^T``, optionally ``slice_rows`` weight rows
    at a time into contiguous rows of the transposed result. Returns a contiguous ``[rows, out]``."""
    out_t = torch.empty(weight.shape[0], x.shape[0], dtype=x.dtype, device=x.device)  # [out, rows]
    step = slice_rows or weight.shape[0]
    x_t = x.t()
    for s in range(0, weight.shape[0], step):
        torch.mm(weight[s : s + step], x_t, out=out_t[s : s + step])
    return out_t.t().contiguous()


class Linear(nn.Linear):
    """``nn.Linear`` that takes the transposed form on CPU for up to FEW_ROWS rows on several threads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or x.shape[0] > FEW_ROWS or torch.get_num_threads() == 1:
            return F.linear(x, self.weight, self.bias)
        out = linear_transposed(x, self.weight)
        return out if self.bias is None else out.add_(self.bias)
