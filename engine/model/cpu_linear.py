"""``x @ W^T`` on CPU in whichever of four forms this machine runs faster, chosen by timing at load.

With few rows (a decode step) the plain product ``[rows, in] x [in, out]`` can leave MKL little to
split across threads; the transposed ``W @ x^T`` splits the long ``out`` side instead. Which form wins,
and up to how many rows, depends on the CPU, so it is measured rather than assumed. Two machines,
same code, whole decode steps of the ``small`` model on two threads:

- a 2-core AMD EPYC: the transposed form was faster up to 64 rows (-15% per step at batch 8, -10% at
  64 for the projections; the LM head -10% at 8, -6% at 64);
- a 2-core AVX-512 Xeon: faster at 16-32 rows but slower at 64 (projections 12.4 vs 10.2 ms, LM head
  9.2 vs 6.8 ms), and the whole 64-request engine benchmark ran 7% faster with the plain form above
  32 rows.

A third form keeps the weight in oneDNN's blocked layout (packed once at load): the product then reads
it without MKL repacking the weight on every call, which is what makes the two dense forms slow at a
few rows. The fourth is the C linear (kernels/cpu/linear.c) on a copy in its own layout (also made once
at load): one sequential stream over the weight with a register-tiled product, close to the memory's
speed at a few rows and to the arithmetic's at a few dozen. Whole-model weight passes (every projection
and the LM head of the ``small`` model, cold in cache as in a real step), one thread, ms:

    rows                      1     2     4     8    16    32    64
    2026-11-24 Xeon  plain   7.5   7.7  15.1  22.5  19.2  23.4  35.8
                     packed  8.0   8.6   9.7  11.6  14.8  20.8  31.7
    2026-11-25 EPYC  plain  14.3  25.6  23.3  26.0  32.8  45.8  73.6
                     C       6.8   6.1   6.6   8.2  15.0  25.6  49.0

So ``time_forms`` times every form at the row counts of ``ROW_BUCKETS`` (``x.shape[0]`` goes to the
first bucket that holds it) and each bucket takes the fastest of the copies held. More rows than the
last bucket (prefill) take the packed form where that copy is held, else plain: the C linear does not
block for the caches a long prefill needs (512 rows: packed 228 ms, plain 230). Copies: one for the
torch forms (packed where it wins most of the buckets the C linear does not, else dense), plus the C
linear's where it wins a bucket; never three. All forms give the same values up to float rounding
(tests/test_cpu_linear.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from bisect import bisect_left
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import forms_cache
from kernels.cpu.native import NativeLibrary

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 8, 16, 32, 48, 64, 96, 128)  # row counts timed at load
LM_HEAD_SLICE_ROWS = 1024  # weight rows per matmul in the LM head's transposed form


FORMS = ("plain", "transposed", "packed", "c")

# time_forms' picks in this process (per bucket, prefill), by what they were timed on
_picked: dict[tuple, dict[str, tuple[tuple[str, ...], str]]] = {}


@dataclass(slots=True, frozen=True)
class MatmulForms:
    """For one weight: the form each row bucket takes, and so which copies of the weight are held."""

    per_bucket: tuple[str, ...] = ()  # a FORMS entry per ROW_BUCKETS entry; () = plain everywhere
    slice_rows: int | None = None  # the transposed form's weight rows per matmul (None: all at once)
    native: NativeLibrary | None = None  # the C kernels, where some bucket takes "c"
    prefill: str = "plain"  # the form past the last bucket: "packed" or "plain" (the torch copy held)

    def __post_init__(self) -> None:
        assert len(self.per_bucket) in (0, len(ROW_BUCKETS)) and set(self.per_bucket) <= set(FORMS), self.per_bucket
        assert ("c" in self.per_bucket) == (self.native is not None)
        assert self.prefill in ("packed", "plain")
        torch_forms = {f for f in self.per_bucket if f != "c"} | {self.prefill}
        assert torch_forms in ({"packed"}, {"plain"}, {"plain", "transposed"}), self  # one torch copy

    @property
    def holds_packed(self) -> bool:
        return self.prefill == "packed"

    @property
    def holds_dense(self) -> bool:  # the two torch forms read the dense weight
        return self.prefill == "plain"

    @property
    def holds_c(self) -> bool:  # the C kernel reads its own copy
        return self.native is not None

    def form_for(self, rows: int) -> str:
        bucket = bisect_left(ROW_BUCKETS, rows)
        return self.per_bucket[bucket] if bucket < len(self.per_bucket) else self.prefill

    def with_c_up_to(self, rows: int, native: NativeLibrary) -> MatmulForms:
        """These forms with the C linear at every bucket up to ``rows`` (engine/model/decode_step.py says why)."""
        per_bucket = self.per_bucket or ("plain",) * len(ROW_BUCKETS)
        per_bucket = tuple("c" if bucket <= rows else form for bucket, form in zip(ROW_BUCKETS, per_bucket))
        return MatmulForms(per_bucket, self.slice_rows, native, self.prefill)

    def describe(self) -> str:
        by_form: dict[str, list[str]] = {}
        for rows, form in zip(ROW_BUCKETS, self.per_bucket):
            by_form.setdefault(form, []).append(str(rows))
        copies = f" (C and {'packed' if self.holds_packed else 'dense'} copies)" if self.holds_c else ""
        if len(by_form) <= 1:
            return next(iter(by_form), "plain") + copies
        return ", ".join(f"{form} at {'/'.join(rows)}" for form, rows in by_form.items()) + " rows" + copies


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


@dataclass(slots=True)
class WeightCopies:
    """The copies of one ``[out, in]`` weight that its ``MatmulForms`` read; None where not held."""

    dense: torch.Tensor | None  # plain and transposed
    packed: torch.Tensor | None = None  # oneDNN's blocked layout (pack_weight)
    c: torch.Tensor | None = None  # the C linear's layout (NativeLibrary.pack_linear)

    @classmethod
    def make(cls, weight: torch.Tensor, forms: MatmulForms) -> WeightCopies:
        """The copies ``forms`` reads, made from the dense ``weight`` (kept only where read)."""
        return cls(
            weight if forms.holds_dense else None,
            pack_weight(weight) if forms.holds_packed else None,
            forms.native.pack_linear(weight) if forms.holds_c else None,
        )


def linear(
    x: torch.Tensor, copies: WeightCopies, bias: torch.Tensor | None = None, forms: MatmulForms = PLAIN
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the form ``forms`` picks for ``x``'s row count (plain on CUDA),
    reading the copy of the weight that form takes."""
    form = "plain" if x.is_cuda else forms.form_for(x.shape[0])
    if form == "c":
        return forms.native.linear(x, copies.c, bias)
    if form == "packed":
        return linear_packed(x, copies.packed, bias)
    if form == "plain":
        return F.linear(x, copies.dense, bias)
    out = linear_transposed(x, copies.dense, forms.slice_rows)
    return out if bias is None else out.add_(bias)


def time_forms(
    groups: dict[str, list[torch.Tensor]],
    slice_rows: dict[str, int | None] | None = None,
    repeats: int = 3,
    native: NativeLibrary | None = None,
) -> dict[str, MatmulForms]:
    """Times the forms (CPU, at the current torch thread count) for each group of same-shape weights
    (every layer's copy of one projection; the LM head alone) at every row bucket, and picks.

    Each timed pass runs one form over every weight of every group in model order, as a step reads
    them, and times each group's share: a weight then comes from the last-level cache or memory as
    in a step. Timed one shape at a time, the weights stay in L2 or a warm L3 and the forms rank
    differently than in steps (at 1-8 rows: the C linear 10-25% slower there, 20-30% faster in steps).

    Which copies to hold: one torch copy, packed where the packed form wins most of the buckets the C
    linear does not (all of them without the C kernel: ``native`` None, or a shape it lacks), else
    dense; plus the C linear's own copy where it is the fastest of all forms at some bucket. Each
    bucket takes the fastest form among the copies held.

    Timed once per process for the same weight shapes, thread count and kernels: two engines of one
    model in one process (a test's reference beside the engine under test) then compute alike, where
    timing noise could otherwise give them forms whose float rounding differs. And once per machine:
    the picks are kept on disk (``kernels/cpu/forms_cache.py``) for the next process to start."""
    slice_rows = slice_rows or {}
    if not groups:  # every weight quantized (a GGUF file's projections and head): nothing float to time
        return {}
    key = (
        tuple((k, len(ws), tuple(ws[0].shape), ws[0].dtype, slice_rows.get(k)) for k, ws in groups.items()),
        repeats,
        torch.get_num_threads(),
        torch.backends.mkldnn.enabled,
        None if native is None else native.threaded,
    )
    if key not in _picked:
        path = forms_cache.path_for(key, None if native is None else native.name)
        picks = forms_cache.load(path, list(groups), FORMS, len(ROW_BUCKETS))
        if picks is None:
            log.info(
                "timing CPU matmul forms for %d weight shapes at %d row counts (first start on this "
                "machine, model and thread count; the picks are kept in %s)",
                len(groups),
                len(ROW_BUCKETS),
                path,
            )
            started = time.monotonic()
            picks = {
                k: (forms.per_bucket, forms.prefill)
                for k, forms in _timed_picks(groups, slice_rows, repeats, native).items()
            }
            forms_cache.store(path, picks)
            log.info("timed CPU matmul forms in %.1f s", time.monotonic() - started)
        else:
            log.info("CPU matmul forms found in the cache %s: no timing", path)
        _picked[key] = picks
    return {
        k: MatmulForms(per_bucket, slice_rows.get(k), native if "c" in per_bucket else None, prefill)
        for k, (per_bucket, prefill) in _picked[key].items()
    }


def _timed_picks(
    groups: dict[str, list[torch.Tensor]], slice_rows: dict[str, int | None], repeats: int, native: NativeLibrary | None
) -> dict[str, MatmulForms]:
    first = next(iter(groups.values()))[0]
    x = torch.randn(ROW_BUCKETS[-1], max(ws[0].shape[1] for ws in groups.values()), dtype=first.dtype)
    times = {key: [{} for _ in ROW_BUCKETS] for key in groups}  # per bucket: form -> seconds
    progress = _Progress(len(FORMS) * len(ROW_BUCKETS))
    for form in FORMS:
        # One form's copies at a time: beside the dense weights, at most one more copy of the model.
        copies = {key: _copies_for(form, ws, native) for key, ws in groups.items()}
        copies = {key: cs for key, cs in copies.items() if cs}
        forms = {
            key: MatmulForms(
                (form,) * len(ROW_BUCKETS),
                slice_rows.get(key),
                native if form == "c" else None,
                "packed" if form == "packed" else "plain",
            )
            for key in copies
        }
        for bucket, rows in enumerate(ROW_BUCKETS):
            _timed_pass(copies, forms, x[:rows])  # warm-up: allocation, kernel choice
            for _ in range(repeats):
                for key, seconds in _timed_pass(copies, forms, x[:rows]).items():
                    times[key][bucket][form] = min(times[key][bucket].get(form, float("inf")), seconds)
            progress.advance(f"{form} at {rows} rows", form_done=bucket == len(ROW_BUCKETS) - 1)
    return {key: _pick(times[key], slice_rows.get(key), native) for key in groups}


class _Progress:
    """Progress lines while the forms are timed (minutes for a large model on few cores): one at the end
    of each form, and one whenever ``every_s`` passed since the last."""

    def __init__(self, total: int, every_s: float = 5.0) -> None:
        self.total, self.done, self.every_s = total, 0, every_s
        self.started = self.last = time.monotonic()

    def advance(self, what: str, form_done: bool) -> None:
        self.done += 1
        now = time.monotonic()
        if form_done or now - self.last >= self.every_s:
            self.last = now
            log.info(
                "timing CPU matmul forms: %d/%d passes (%s), %.1f s", self.done, self.total, what, now - self.started
            )


def _copies_for(form: str, weights: list[torch.Tensor], native: NativeLibrary | None) -> list[WeightCopies]:
    """Each weight's copy that ``form`` reads; [] where the form cannot take this group."""
    if form == "packed":
        packed = [pack_weight(w) for w in weights]
        return [] if packed[0] is None else [WeightCopies(w, p) for w, p in zip(weights, packed)]
    if form == "c":
        takes = native is not None and native.takes_weight(weights[0])
        return [WeightCopies(w, c=native.pack_linear(w)) for w in weights] if takes else []
    return [WeightCopies(w) for w in weights]


def _timed_pass(
    copies: dict[str, list[WeightCopies]], forms: dict[str, MatmulForms], x: torch.Tensor
) -> dict[str, float]:
    """One pass over every layer's weights in model order, each group in its ``forms``: seconds spent per
    group."""
    spent = {key: 0.0 for key in copies}
    for i in range(max((len(cs) for cs in copies.values()), default=0)):
        for key, group in copies.items():
            if i < len(group):
                weight = group[i]
                start = time.perf_counter()
                linear(x[:, : weight.dense.shape[1]], weight, forms=forms[key])
                spent[key] += time.perf_counter() - start
    return spent


def _pick(times: list[dict[str, float]], slice_rows: int | None, native: NativeLibrary | None) -> MatmulForms:
    """The forms from one group's times per bucket (``time_forms`` says how)."""
    c_best = [min(t, key=t.get) == "c" for t in times]
    rest = [t for t, c in zip(times, c_best) if not c] or times[-1:]  # the torch copy serves prefill too
    packed_wins = sum("packed" in t and t["packed"] < min(t["plain"], t["transposed"]) for t in rest)
    prefill = "packed" if 2 * packed_wins > len(rest) else "plain"
    held = {"packed"} if prefill == "packed" else {"plain", "transposed"}
    if any(c_best):
        held.add("c")
    per_bucket = tuple(min((f for f in t if f in held), key=t.get) for t in times)
    return MatmulForms(per_bucket, slice_rows, native if "c" in per_bucket else None, prefill)


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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process on this machine to finish timing its CPU forms (%s)", path)
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
        self.copies: WeightCopies | None = None  # set by use_forms
        # (layer index, module name) and the model's LoRA step holder, once LoRA is enabled
        # (engine/lora/manager.py): the step's adapters add their deltas to the output
        self.lora_key: tuple[int, str] | None = None
        self.lora_ref = None

    def use_forms(self, forms: MatmulForms) -> None:
        """From now on compute in ``forms``, holding the copies of the weight they read (the dense
        ``self.weight`` is freed where none reads it)."""
        self.copies = WeightCopies.make(self.weight, forms)
        self.weight = self.copies.dense
        self.forms = forms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copies is None:  # no forms chosen (CUDA, or before timing): plain
            y = F.linear(x, self.weight, self.bias)
        else:
            y = linear(x, self.copies, self.bias, self.forms)
        if self.lora_ref is not None and self.lora_ref.step.groups:
            self.lora_ref.step.add_delta(self.lora_key, x, y)
        return y
