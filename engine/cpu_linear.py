"""``x @ W^T`` on CPU in whichever of three forms this machine runs faster, chosen by timing at load.

With few rows (a decode step) the plain product ``[rows, in] x [in, out]`` can leave MKL little to
split across threads; the transposed ``W @ x^T`` splits the long ``out`` side instead. Which form wins,
and up to how many rows, depends on the CPU, so it is measured rather than assumed. Two machines,
same code, whole decode steps of the ``small`` model on two threads:

- a 2-core AMD EPYC: the transposed form was faster up to 64 rows (-15% per step at batch 8, -10% at
  64 for the projections; the LM head -10% at 8, -6% at 64);
- a 2-core AVX-512 Xeon: faster at 16-32 rows but slower at 64 (projections 12.4 vs 10.2 ms, LM head
  9.2 vs 6.8 ms), and the whole 64-request engine benchmark ran 7% faster with the plain form above
  32 rows.

So ``time_forms`` times both forms for one weight at the row counts of ``ROW_BUCKETS`` (``x.shape[0]``
goes to the first bucket that holds it); more rows than the last bucket (prefill) always take the
plain form, which wins there everywhere measured (+31% for the transposed form on a 2,048-token step).
A third form keeps the weight in oneDNN's blocked layout (packed once at load): the product then reads
it without MKL repacking the weight on every call, which is what makes the two dense forms slow at a
few rows. Whole-model weight passes (every projection and the LM head of the ``small`` model, cold in
cache as in a real step), 2026-11-24 Xeon, one thread: 4 rows 11.6 ms packed against 16.6 ms for the
better dense form, 8 rows 13.7 vs 22.0, 16 rows 16.4 vs 22.5, 64 rows 35.0 vs 38.0, 512 rows 228 vs
230; one row 9.5 vs 7.9. Storing both would double the weights' memory, so a weight is either packed
(when the packed form is the faster one at most row buckets) or dense, and then packed for every row
count, prefill included. All forms give the same values up to float rounding (tests/test_cpu_linear.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from bisect import bisect_left
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROW_BUCKETS = (1, 4, 8, 16, 32, 48, 64, 96, 128)  # row counts timed at load
LM_HEAD_SLICE_ROWS = 1024  # weight rows per matmul in the LM head's transposed form


@dataclass(slots=True, frozen=True)
class MatmulForms:
    """For one weight: per row bucket, whether the transposed form is the faster one."""

    transposed: tuple[bool, ...] = ()  # one flag per ROW_BUCKETS entry; () = always plain
    slice_rows: int | None = None  # the transposed form's weight rows per matmul (None: all at once)
    packed: bool = False  # the weight is held packed (pack_weight) and every row count takes that form

    def __post_init__(self) -> None:
        assert len(self.transposed) in (0, len(ROW_BUCKETS)), self.transposed

    def use_transposed(self, rows: int) -> bool:
        bucket = bisect_left(ROW_BUCKETS, rows)
        return bucket < len(self.transposed) and self.transposed[bucket]

    def describe(self) -> str:
        if self.packed:
            return "packed (oneDNN)"
        rows = [str(r) for r, t in zip(ROW_BUCKETS, self.transposed) if t]
        return f"transposed at {'/'.join(rows)} rows" if rows else "plain"


PLAIN = MatmulForms()


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, slice_rows: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` computed as ``(weight @ x^T)^T``, optionally ``slice_rows`` weight rows
    at a time into contiguous rows of the transposed result. Returns a contiguous ``[rows, out]``."""
    out_t = torch.empty(weight.shape[0], x.shape[0], dtype=x.dtype, device=x.device)  # [out, rows]
    step = slice_rows or weight.shape[0]
    x_t = x.t()
    for s in range(0, weight.shape[0], step):
        torch.mm(weight[s : s + step], x_t, out=out_t[s : s + step])
    return out_t.t().contiguous()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ([out, in], float32, CPU) in oneDNN's blocked layout for ``linear_packed``; None where
    this torch has no oneDNN (or it is switched off: ``torch.backends.mkldnn.flags(enabled=False)``)
    or the weight is not one it is measured on here."""
    usable = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not usable:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)``."""
    # oneDNN reads x as if it were contiguous: the MLP's strided down_proj input gave wrong values.
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           forms: MatmulForms = PLAIN) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the form ``forms`` picks for ``x``'s row count (plain on CUDA).
    ``weight`` is the dense one, or the packed one when ``forms.packed``."""
    if forms.packed:
        return linear_packed(x, weight, bias)
    if x.is_cuda or not forms.use_transposed(x.shape[0]):
        return F.linear(x, weight, bias)
    out = linear_transposed(x, weight, forms.slice_rows)
    return out if bias is None else out.add_(bias)


def time_forms(weight: torch.Tensor, slice_rows: int | None = None, repeats: int = 3) -> MatmulForms:
    """Times the forms on ``weight`` (CPU, at the current torch thread count) at every row bucket."""
    x = torch.randn(ROW_BUCKETS[-1], weight.shape[1], dtype=weight.dtype)
    packed = pack_weight(weight)
    flags, packed_wins = [], 0
    for rows in ROW_BUCKETS:
        rows_x = x[:rows]
        plain = best_seconds(lambda: F.linear(rows_x, weight), repeats)
        transposed = best_seconds(lambda: linear_transposed(rows_x, weight, slice_rows), repeats)
        flags.append(transposed < plain)
        if packed is not None:
            packed_wins += best_seconds(lambda: linear_packed(rows_x, packed), repeats) < min(plain, transposed)
    return MatmulForms(tuple(flags), slice_rows, packed=2 * packed_wins > len(ROW_BUCKETS))


@contextlib.contextmanager
def exclusive_timing(lock_path: str | None = None):
    """Held while a process times the forms, so the workers ``pdserve serve`` starts together on one
    machine time one after another. Timed at once they contend for the memory bus in a way no served
    step does: measured on the 2-core Xeon, two processes timing together picked the dense LM head on
    every try (alone: packed on every try), and a decode worker started that way took 20-22 ms per
    step at batch 2-4 where the packed head took 17-18, alone and beside a prefilling worker alike.
    Where the lock file cannot be opened, timing goes ahead unlocked."""
    path = lock_path or os.path.join(tempfile.gettempdir(), "pdserve-cpu-timing.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


def best_seconds(run, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run``, after one untimed warm-up call."""
    run()  # warm-up: first-call allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


class Linear(nn.Linear):
    """``nn.Linear`` that takes the form ``self.forms`` picks (plain until ``use_forms`` sets it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forms = PLAIN
        self.packed_weight: torch.Tensor | None = None

    def use_forms(self, forms: MatmulForms) -> None:
        """From now on compute in ``forms``; a packed form replaces the dense weight (freed)."""
        if forms.packed:
            self.packed_weight = pack_weight(self.weight)
            self.weight = None
        self.forms = forms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed_weight if self.forms.packed else self.weight, self.bias, self.forms)
