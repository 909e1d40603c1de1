"""What a prefill worker's Commit must satisfy before its KV joins a request on this node.

The decode worker cannot recompute the prompt, but it can check everything the Commit claims beside the
KV: the adapter it was computed under, the first token's presence, range and grammar. A Commit that
fails a check fails its request; the reason names the value and whose fault it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.sequence import Sequence
from protocol.kv_messages import Commit

PREFILL = "prefill"  # culprit: the prefill worker the request relied on (protocol/serving.py CULPRITS)
NO_ONE = "none"  # culprit: neither worker misbehaved (an operator rewrote an adapter's files, say)


@dataclass(slots=True, frozen=True)
class CommitProblem:
    error: str  # what the request's client is told
    culprit: str  # PREFILL or NO_ONE
    bad_token: int | None = None  # a token outside the vocabulary: also counted as a rejected frame


def commit_problem(commit: Commit, seq: Sequence, vocab_size: int) -> CommitProblem | None:
    """None when ``commit`` may complete ``seq``'s prompt, else what is wrong with it."""
    if commit.lora_name != seq.params.lora_name:
        return CommitProblem(
            f"prefill worker computed the KV under LoRA adapter {commit.lora_name!r}; the request "
            f"runs under {seq.params.lora_name!r}",
            PREFILL,
        )
    own_digest = seq.params.lora_digest
    if commit.lora_digest != own_digest:  # same name, other files: the directory changed between loads
        return CommitProblem(
            f"prefill worker computed the KV under LoRA adapter {commit.lora_name!r} read from other files "
            f"(sha256 {commit.lora_digest[:12]!r}) than this worker's ({own_digest[:12]!r}): load it again",
            NO_ONE,
        )
    if seq.params.n == 1 and commit.first_token is None:
        return CommitProblem("prefill worker committed without the first token", PREFILL)
    bad = [t for t in [commit.first_token, *commit.top_token_ids] if t is not None and not 0 <= t < vocab_size]
    if bad:
        return CommitProblem(
            f"prefill worker sent token {bad[0]}, outside the vocabulary of {vocab_size}", PREFILL, bad_token=bad[0]
        )
    if seq.params.n == 1 and seq.guide is not None and not seq.guide.accept(commit.first_token):
        return CommitProblem(
            f"prefill worker's first token {commit.first_token} is outside the request's grammar", PREFILL
        )
    return None
