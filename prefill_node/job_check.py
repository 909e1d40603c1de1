"""Validation of an incoming PrefillJob: a bad job gets a reason (sent back as PrefillFailed), never a crash."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_manager import cdiv
from engine.sampling.params import SamplingError
from engine.sched.sequence import vocab_error
from prefill_node.sampling import first_token_params
from protocol.endpoints import endpoint_error
from protocol.serving import PrefillJob


@dataclass(slots=True)
class JobLimits:
    vocab_size: int
    block_size: int
    num_blocks: int  # the node's KV pool: a prompt needing more can never run here
    max_model_len: int


def check_job(job: PrefillJob, limits: JobLimits, now: float) -> str:
    """Empty string when ``job`` can run here, else the reason (names the limit and the value)."""
    n, bs = len(job.token_ids), limits.block_size
    if error := endpoint_error(job.kv_address):
        return f"kv_address: {error}"
    try:
        params = first_token_params(job.sampling)
    except SamplingError as exc:
        return str(exc)
    if error := vocab_error(job.token_ids, params, limits.vocab_size):
        return error
    if n >= limits.max_model_len:
        return f"prompt has {n} tokens; this model's context is {limits.max_model_len}"
    if job.skip_tokens % bs:
        return f"skip_tokens {job.skip_tokens} is not a multiple of the block size {bs}"
    expected = cdiv(n - job.skip_tokens, bs)
    if len(job.dst_block_ids) != expected:
        return (
            f"{len(job.dst_block_ids)} destination blocks for tokens [{job.skip_tokens}, {n}); "
            f"expected {expected} of {bs} tokens"
        )
    if len(set(job.dst_block_ids)) != expected or min(job.dst_block_ids) < 0:
        return "destination block ids must be distinct and non-negative"
    if cdiv(n, bs) > limits.num_blocks:
        return f"prompt needs {cdiv(n, bs)} KV blocks; this node's pool holds {limits.num_blocks}"
    if job.deadline <= now:
        return f"deadline passed {now - job.deadline:.3f} s ago"
    return ""
