"""Generate -> Sequence: validate what the gateway sent and build the engine's sequence.

Everything wrong here is the request's fault, so it raises ``RequestError`` whose message reaches
the client (it names the limit and the value).
"""

from __future__ import annotations

import dataclasses

from engine.model_config import ModelConfig
from engine.sampling_params import SamplingError, SamplingParams
from engine.sequence import Sequence
from protocol.serving import Generate, SamplingSpec


class RequestError(ValueError):
    """A request this worker refuses for good (not Busy): bad tokens, bad sampling, too long."""


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """Field names and meanings are the same on both sides (protocol/serving.py)."""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    try:
        return SamplingParams(**values)
    except SamplingError as exc:
        raise RequestError(str(exc)) from None


def make_sequence(seq_id: int, gen: Generate, model: ModelConfig) -> Sequence:
    vocab = model.vocab_size
    bad = next((t for t in gen.token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside this model's vocabulary of {vocab} tokens")
    params = sampling_params(gen.sampling)
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(model.eos_token_ids)
    return Sequence(seq_id, list(gen.token_ids), params, stop_token_ids=frozenset(stops))
