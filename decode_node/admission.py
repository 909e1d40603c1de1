"""Generate -> Sequence: validate what the gateway sent and build the engine's sequence.

Everything wrong here is the request's fault, so it raises ``RequestError`` whose message reaches
the client (it names the limit and the value).
"""

from __future__ import annotations

import dataclasses

from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingError, SamplingParams
from engine.sched.sequence import Sequence, vocab_error
from protocol.serving import Generate, SamplingSpec


class RequestError(ValueError):
    """A request this worker refuses for good (not Busy): bad tokens, bad sampling, too long."""


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """Field names and meanings are the same on both sides (protocol/serving.py)."""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    values["logit_bias"] = spec.logit_bias_map()
    try:
        return SamplingParams(**values)
    except SamplingError as exc:
        raise RequestError(str(exc)) from None


def make_sequence(seq_id: int, gen: Generate, engine: LLMEngine) -> Sequence:
    params = sampling_params(gen.sampling)
    model = engine.model_config
    if error := vocab_error(gen.token_ids, params, model.vocab_size) or engine.lora_error(params):
        raise RequestError(error)
    # A structured output's guide comes later, from its compile (the server's COMPILING phase).
    return Sequence(seq_id, list(gen.token_ids), params, stop_token_ids=params.stop_ids(model.eos_token_ids))
