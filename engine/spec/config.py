"""The ``--speculative-config`` JSON, as vLLM takes it.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 4}
    {"method": "draft_model", "model": "self:4", "num_speculative_tokens": 4}   (the target's first 4 layers)

Back-off keys (pdserve's own; vLLM has no equivalent): ``max_num_seqs`` — no sequence speculates while more
than this many run (the batch then fills the weight pass by itself); ``min_acceptance`` — a sequence whose
acceptance rate (an exponentially weighted average over its steps) falls below this stops proposing until
the average, which creeps back up while it waits, says to try again; ``verify_row_cost`` — what one more
row of a step costs relative to a one-row decode step, the cost model that picks each sequence's
number of drafts (up to ``num_speculative_tokens``) and backs it off where drafts cost more than they
earn (engine/spec/draft_length.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


class SpeculativeConfigError(ValueError):
    """A ``--speculative-config`` that cannot be used; the message names the key and the value."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int = 4  # k: draft tokens verified per step at most
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram looked up in the prompt and output
    prompt_lookup_min: int = 1  # ngram: shortest one
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer as the target), or "self:N"
    max_num_seqs: int = 8  # no speculation while more sequences than this run
    min_acceptance: float = 0.2  # a sequence below this acceptance rate backs off
    verify_row_cost: float = 0.08  # one more row's cost, relative to a one-row step (the draft length's cost model)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise SpeculativeConfigError(f"num_speculative_tokens={self.num_speculative_tokens}; it must be in 1..32")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}; "
                "need 1 <= min <= max"
            )
        if self.method == "draft_model" and not self.model:
            raise SpeculativeConfigError('method "draft_model" needs "model": the draft checkpoint')
        if self.max_num_seqs < 1:
            raise SpeculativeConfigError(f"max_num_seqs={self.max_num_seqs}; it must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise SpeculativeConfigError(f"min_acceptance={self.min_acceptance}; it must be in [0, 1]")
        if not 0.0 <= self.verify_row_cost <= 1.0:
            raise SpeculativeConfigError(f"verify_row_cost={self.verify_row_cost}; it must be in [0, 1]")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The config a ``--speculative-config`` string names; None for the empty string (no speculation)."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError("--speculative-config must be a JSON object")
    known = {f.name: f.type for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SpeculativeConfigError(f"--speculative-config has unknown keys {unknown}; known: {sorted(known)}")
    for key, value in raw.items():
        want = (
            float if key in ("min_acceptance", "verify_row_cost") else int if "num" in key or "lookup" in key else str
        )
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = raw[key] = float(value)
        if not isinstance(value, want) or isinstance(value, bool):
            raise SpeculativeConfigError(f"--speculative-config key {key!r}={value!r} must be {want.__name__}")
    return SpeculativeConfig(**raw)
