"""Which form (engine/quant/linear.py) each row count of each quantized weight shape takes, timed at start.

As ``time_forms`` does for the float forms (engine/model/cpu_linear.py): each timed pass runs one form
over every weight of every group in model order, so each weight comes from memory as in a step, and
each bucket takes the faster form. Timed once per process for the same shapes, formats and thread count,
and once per machine: the picks are kept on disk beside the float ones (kernels/cpu/forms_cache.py,
keyed by the CPU, torch, the quantized kernels' build, the shapes, formats and thread count), since
timing them took 44-139 s of a worker's start on a loaded 2-core EPYC and a restart must not re-time.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.model.cpu_linear import ROW_BUCKETS
from engine.quant.linear import QUANT_FORMS, QuantLinear, quantized_linear
from kernels.cpu import forms_cache

log = logging.getLogger(__name__)

_picked: dict[tuple, tuple[str, ...]] = {}


def choose_quant_forms(modules: list[QuantLinear], repeats: int = 2) -> dict[str, tuple[str, ...]]:
    """Times both forms for each group of same-shape, same-format modules and sets their picks; returns
    the picks by group name ("Q4_K 1728x576"), for the log."""
    groups: dict[str, list[QuantLinear]] = {}
    for m in modules:
        groups.setdefault(f"{m.qweight.type_name} {m.out_features}x{m.in_features}", []).append(m)
    threads = torch.get_num_threads()
    keys = {g: (g, len(ms), repeats, threads) for g, ms in groups.items()}
    todo = {g: ms for g, ms in groups.items() if keys[g] not in _picked}
    if todo:
        # "quantized" apart from the float forms' keys; the libraries' names carry their sources' hashes
        libs = "+".join(sorted({m.lib.name for ms in todo.values() for m in ms}))
        path = forms_cache.path_for(("quantized", tuple(sorted(keys[g] for g in todo))), libs)
        stored = forms_cache.load_per_bucket(path, list(todo), QUANT_FORMS, len(ROW_BUCKETS))
        if stored is None:
            log.info("timing quantized matmul forms for %d weight shapes (the picks are kept in %s)", len(todo), path)
            started = time.monotonic()
            picks = _timed(todo, repeats)
            forms_cache.store_per_bucket(path, picks)
            log.info("timed quantized matmul forms in %.1f s", time.monotonic() - started)
        else:
            log.info("quantized matmul forms found in the cache %s: no timing", path)
            picks = stored
        for g, per_bucket in picks.items():
            _picked[keys[g]] = per_bucket
    chosen = {g: _picked[keys[g]] for g in groups}
    for g, ms in groups.items():
        for m in ms:
            m.use_forms(chosen[g])
    return chosen


def _timed(groups: dict[str, list[QuantLinear]], repeats: int) -> dict[str, tuple[str, ...]]:
    width = max(ms[0].in_features for ms in groups.values())
    x = torch.randn(ROW_BUCKETS[-1], width)
    best = {g: [dict.fromkeys(QUANT_FORMS, float("inf")) for _ in ROW_BUCKETS] for g in groups}
    for bucket, rows in enumerate(ROW_BUCKETS):
        for form in QUANT_FORMS:
            for attempt in range(repeats + 1):  # the first is a warm-up
                spent = _timed_pass(groups, form, x[:rows])
                for g, seconds in spent.items():
                    if attempt:
                        best[g][bucket][form] = min(best[g][bucket][form], seconds)
    return {g: tuple(min(t, key=t.get) for t in best[g]) for g in groups}


def _timed_pass(groups: dict[str, list[QuantLinear]], form: str, x: torch.Tensor) -> dict[str, float]:
    spent = dict.fromkeys(groups, 0.0)
    for i in range(max(len(ms) for ms in groups.values())):
        for g, ms in groups.items():
            if i < len(ms):
                m = ms[i]
                start = time.perf_counter()
                quantized_linear(x[:, : m.in_features], m.qweight, m.lib, form, m.bias)
                spent[g] += time.perf_counter() - start
    return spent


def describe(chosen: dict[str, tuple[str, ...]]) -> str:
    """'Q4_K 1728x576 int up to 16 rows, then panel; ...' for the log."""
    parts = []
    for g, picks in chosen.items():
        runs = [f"{form} at {rows}" for rows, form in zip(ROW_BUCKETS, picks)]
        parts.append(f"{g}: {', '.join(runs)}, {picks[-1]} past {ROW_BUCKETS[-1]}")
    return "; ".join(parts)
