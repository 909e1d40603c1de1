"""A sequence: one prompt and the tokens generated after it, and where its KV lives.

Token positions of a running sequence (``|`` marks the counters):

    token_ids:  [ prompt ........................ | outputs ....... ]
                0         num_cached_tokens       num_prompt_tokens    num_tokens
                |-- from the prefix cache --|
                |---------- num_computed_tokens (KV in the pool) ----------|
    block_table covers ceil(num_computed_tokens / block_size) blocks at least.

"Each request's computed tokens catch up with its known tokens": a step computes
``token_ids[num_computed_tokens : num_computed_tokens + n]``; when that reaches ``num_tokens`` the step
also samples one new token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling.params import SamplingParams
from engine.sampling.structured_output import Guide


class SequenceStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 0  # queued (new or preempted); holds no blocks
    RUNNING = 1  # holds blocks; prefilling chunks or decoding
    FINISHED_STOPPED = 2  # sampled a stop token or EOS
    FINISHED_LENGTH = 3  # reached max_tokens or the model's context
    FINISHED_ABORTED = 4  # cancelled by the caller


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # params.stop_ids(the model's EOS ids)
    num_prompt_tokens: int = -1  # set from token_ids when not given
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block ids, in token order
    num_computed_tokens: int = 0  # leading tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, never recomputed
    generator: object | None = None  # torch.Generator of a seeded request (owned by the sampler)
    guide: Guide | None = None  # a structured output's place in its grammar, fed every output token
    output_logprobs: list = field(default_factory=list)  # one entry per generated token when asked
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1, 2, ... when asked
    spec: SpecState = field(default_factory=lambda: SpecState())  # speculative decoding's counters (engine/spec/)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        assert 0 < self.num_prompt_tokens <= len(self.token_ids), "a sequence needs a prompt"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all computed yet (so its prompt must be computed here,
        not taken from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation record: what its drafts earned, for the back-off and its log line."""

    num_drafts: int = 0  # steps that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    acceptance: float = 1.0  # exponentially weighted acceptance rate; starts hopeful so the first step tries
    num_wait_steps: int = 0  # steps to skip before proposing again (the back-off)
    backoff: int = 0  # the next wait when acceptance stays low; doubles on each poor probe
    # q_0..q_{k-1} [k, V] of this step's drafts when a draft model sampled them; None: point mass or greedy
    draft_probs: object | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def vocab_error(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int) -> str:
    """Empty when every token id a request names (its prompt, logit_bias, allowed_token_ids) is in the vocabulary, else
    the reason, naming the id: the model and the sampler index by these ids."""
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"prompt token id {bad} is outside this model's vocabulary of {vocab_size} tokens"
    for name in ("logit_bias", "allowed_token_ids"):
        bad = next((t for t in getattr(params, name) or () if t >= vocab_size), None)
        if bad is not None:
            return f"{name} token id {bad} is outside this model's vocabulary of {vocab_size} tokens"
    return ""
