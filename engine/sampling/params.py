"""Per-request sampling parameters, validated once with vLLM's ranges; errors name the parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.serving import MAX_LOGIT_BIAS, StructuredOutput

if TYPE_CHECKING:
    from engine.lora.adapter import LoRAAdapter


class SamplingError(ValueError):
    """An out-of-range sampling value; the message names the parameter and the value."""


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt; the prompt's blocks are shared copy-on-write
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 (or -1) disables; else keep the k most likely tokens
    min_p: float = 0.0  # drop tokens below min_p * p(most likely), in [0, 1]
    seed: int | None = None  # per-request seed: same tokens whatever the batch around it
    presence_penalty: float = 0.0  # in [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # in [-2, 2], over generated tokens
    repetition_penalty: float = 1.0  # in [2^-16, 2^16], over prompt and generated tokens (HF semantics)
    max_tokens: int = 16  # new tokens at most
    min_tokens: int = 0  # stop tokens and EOS are masked until this many are generated
    stop_token_ids: list[int] = field(default_factory=list)  # ends the sequence (kept in output)
    ignore_eos: bool = False  # keep generating past the model's EOS
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus top-k
    max_logprobs: int = 20  # upper bound accepted for ``logprobs``
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    allowed_token_ids: list[int] | None = None  # vLLM's: None any token; else only these are ever sampled
    # None: none; k >= 0: every prompt token's logprob (after the first) plus the top k. The prompt is
    # then computed in full, never read from the prefix cache: cached tokens have no logits.
    prompt_logprobs: int | None = None
    # None: any output; else the grammar the output follows (engine/sampling/structured_output.py). Compiled at
    # admission into the sequence's matcher, which masks the logits of every step.
    structured_output: StructuredOutput | None = None
    # "" or a tenant's salt: the prefix cache is shared only between requests with the same one (it
    # enters the first block's hash; protocol/hashing.py)
    cache_salt: str = ""
    # "" for the base model, else the LoRA adapter the request runs under (engine/lora/manager.py); it
    # enters the first block's hash too, so no KV is shared across adapters
    lora_name: str = ""
    lora_path: str = ""  # the directory the gateway knows the adapter by ("" offline: this engine's own)
    # Set at admission (LLMEngine.lora_error): the adapter's weights this request runs with to its end
    # (engine/lora/manager.py LoRAManager.pin); its digest enters the block hashes with the name.
    lora_adapter: LoRAAdapter | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def lora_digest(self) -> str:
        """The digest of the adapter files this request runs with ("" for the base, or none pinned yet)."""
        return self.lora_adapter.digest if self.lora_adapter is not None else ""

    def stop_ids(self, eos_token_ids: list[int]) -> frozenset[int]:
        """The token ids that end the sequence (a Sequence's ``stop_token_ids``; the sampler masks them
        while ``min_tokens`` is unmet): the request's stops plus the model's EOS unless ``ignore_eos``."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    def validate(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise SamplingError(f"{name} must be {rule}, got {repr(getattr(self, name))[:200]}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        check(0.0 <= self.temperature <= 2.0**16, "temperature", ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        # Bounded below too: a penalty under float32's range reads as 0 in the sampler and divides by it.
        check(2.0**-16 <= self.repetition_penalty <= 2.0**16, "repetition_penalty", "in [2^-16, 2^16]")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
        )
        check(self.seed is None or isinstance(self.seed, int), "seed", "an integer")
        check(
            self.logit_bias is None
            or all(
                isinstance(t, int)
                and not isinstance(t, bool)
                and t >= 0
                and isinstance(b, (int, float))
                and not isinstance(b, bool)
                and math.isfinite(b)
                and abs(b) <= MAX_LOGIT_BIAS
                for t, b in self.logit_bias.items()
            ),
            "logit_bias",
            f"a map of non-negative token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        check(
            self.allowed_token_ids is None
            or (
                bool(self.allowed_token_ids)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids",
            "a non-empty list of non-negative token ids",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.max_logprobs),
            "logprobs",
            f"an integer in [0, {self.max_logprobs}]",
        )
        check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= self.max_logprobs),
            "prompt_logprobs",
            f"an integer in [0, {self.max_logprobs}]",
        )
        check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            "structured_output",
            "a StructuredOutput",
        )
