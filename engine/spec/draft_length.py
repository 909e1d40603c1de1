"""How many drafts a sequence takes this step: the cost model behind adaptive proposal length and the
back-off (engine/spec/speculator.py).

A sequence's per-token acceptance ``a`` (the chance that the next draft is accepted given the ones
before it were: an average over its recent verifications) makes k drafts worth

    E(k) = a + a^2 + ... + a^k = a (1 - a^k) / (1 - a)      accepted drafts expected

and the step emits one token of its own on top. A step of R rows costs, relative to a one-row decode
step, ``1 + row_cost (R - 1)``: the weights stream once per step whatever R is, each row adds its
arithmetic (f32 SmolLM2-135M on the fused C step of a 2-core EPYC: 17 rows ~2x one row). Among
``rows`` decoding sequences (the step's plain rows), giving one of them k drafts changes the step's
tokens per unit of cost from ``rows / c`` to ``(rows + E(k)) / (c + row_cost k)``, c = the step's
cost without drafts. The best k maximises that; it is worth any drafts at all only when
``E(k) c > rows row_cost k``, i.e. (E(k) / k <= a) only when

    a > row_cost rows / c            (``break_even``)

so copying (a near 1) drafts long, free text (a low) stops, and a full batch (rows large: its weight
pass is already shared by many tokens) needs a higher acceptance than one stream.
"""

from __future__ import annotations


def expected_accepted(acceptance: float, k: int) -> float:
    """E(k) for per-token acceptance ``acceptance`` in [0, 1]."""
    if acceptance >= 1.0:
        return float(k)
    return acceptance * (1.0 - acceptance**k) / (1.0 - acceptance)


def step_cost(rows: int, row_cost: float) -> float:
    """A step of ``rows`` rows relative to a one-row step."""
    return 1.0 + row_cost * (rows - 1)


def break_even(row_cost: float, rows: int) -> float:
    """The per-token acceptance above which drafting pays among ``rows`` decoding sequences."""
    return row_cost * rows / step_cost(rows, row_cost)


def draft_length(acceptance: float, max_k: int, row_cost: float, rows: int) -> int:
    """The k in 1..``max_k`` that gives the most tokens per unit of step cost (the smallest on a tie);
    ``rows``: decoding sequences in the step (>= 1). Whether to draft at all is ``break_even``'s."""
    base = step_cost(rows, row_cost)
    best, best_rate = 1, -1.0
    for k in range(1, max_k + 1):
        rate = (rows + expected_accepted(acceptance, k)) / (base + row_cost * k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
