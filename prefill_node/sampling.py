"""The engine sampling parameters of a prefill job: the request's own, cut to its first token."""

from __future__ import annotations

from engine.sampling.params import SamplingParams
from protocol.serving import SamplingSpec


def first_token_params(spec: SamplingSpec) -> SamplingParams:
    """One completion, one token, sampled as the request asks (seed, filters, logit_bias, allowed_token_ids, logprobs,
    prompt logprobs, min_tokens, structured output).

    ``n`` is 1 even for ``n > 1`` requests: those come with ``sample_first = False`` and the decode
    worker forks the completions itself. Raises SamplingError for an out-of-range value.
    """
    return SamplingParams(
        n=1,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        seed=spec.seed,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        max_tokens=1,
        min_tokens=min(spec.min_tokens, 1),
        stop_token_ids=list(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        logit_bias=spec.logit_bias_map(),
        allowed_token_ids=spec.allowed_token_ids,
        prompt_logprobs=spec.prompt_logprobs,
        structured_output=spec.structured_output,
        cache_salt=spec.cache_salt,
        lora_name=spec.lora_name,
        lora_path=spec.lora_path,
    )
