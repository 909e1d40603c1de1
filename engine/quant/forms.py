"""Which form (engine/quant/linear.py) each row count of each quantized weight shape takes, timed at start.

As ``time_forms`` does for the float forms (engine/model/cpu_linear.py): each timed pass runs one form
over every weight of every group in model order, so each weight comes from memory as in a step, and
each bucket takes the faster form. Timed once per process for the same shapes, formats and thread count.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.model.cpu_linear import ROW_BUCKETS
from engine.quant.linear import QUANT_FORMS, QuantLinear, quantized_linear

log = logging.getLogger(__name__)

_picked: dict[tuple, tuple[str, ...]] = {}


def choose_quant_forms(modules: list[QuantLinear], repeats: int = 2) -> dict[str, tuple[str, ...]]:
    """Times both forms for each group of same-shape, same-format modules and sets their picks; returns
    the picks by group name ("Q4_K 1728x576"), for the log."""
    groups: dict[str, list[QuantLinear]] = {}
    for m in modules:
        groups.setdefault(f"{m.qweight.type_name} {m.out_features}x{m.in_features}", []).append(m)
    keys = {g: (g, len(ms), repeats, torch.get_num_threads()) for g, ms in groups.items()}
    todo = {g: ms for g, ms in groups.items() if keys[g] not in _picked}
    if todo:
        started = time.monotonic()
        for g, picks in _timed(todo, repeats).items():
            _picked[keys[g]] = picks
        log.info("timed quantized matmul forms for %d weight shapes in %.1f s", len(todo), time.monotonic() - started)
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
        parts.append(f"{g}: {', '.join(runs)}, panel past {ROW_BUCKETS[-1]}")
    return "; ".join(parts)
