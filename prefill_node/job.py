"""One prefill job on this node: the decode worker's request, its sequence, and how far it got.

    token_ids:  [ D holds (skip) ......... | D lacks: sent to dst_block_ids ............ ]
                0                          skip_tokens                         len(token_ids)
    blocks:     [ 0 .. first_dst_block-1   | first_dst_block .. next_block-1 sent | not yet ]

``next_block`` only moves forward: a block is pushed once, when this node's computed tokens cover
it (the last chunk also pushes the partial tail block).
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass

from engine.sched.sequence import Sequence
from protocol.serving import PrefillJob
from telemetry.tracing import RequestTrace


class JobPhase(enum.IntEnum):
    """Ordered: a job only moves forward."""

    QUEUED = 0  # waiting for admission (blocks for its whole prompt) or for the scheduler
    PREFILLING = 1  # its sequence is running chunks; finished blocks go out after each step
    TRANSFERRING = 2  # computed; waiting for the receiver to take the last pieces and ack the commit


@dataclass(slots=True, eq=False)
class JobState:
    job: PrefillJob
    peer: bytes  # ROUTER identity of the decode worker that sent the job
    seq: Sequence  # max_tokens = 1: it finishes (and frees its blocks) on its last chunk
    num_blocks_needed: int  # blocks its whole prompt can take here; the admission budget counts them
    arrived_at: float  # time.monotonic() on arrival (TTFT on this node)
    phase: JobPhase = JobPhase.QUEUED
    in_scheduler: bool = False  # handed to the engine's scheduler (admitted)
    next_block: int = 0  # first block index (of token_ids) not yet pushed
    is_sending: bool = False  # the KV sender has a live transfer for it (abort must tell the receiver)
    guide: Future | None = None  # its structured output's guide while that compiles, with its deadline (then on seq)
    trace: RequestTrace | None = None  # its span here when the decode worker traces it (telemetry/tracing.py)
    sender: str = ""  # the CURVE key (insecure: the routing id, hex) that sent it: only it aborts or replaces it

    @property
    def rid(self) -> str:
        return self.job.rid

    @property
    def num_uncomputed_tokens(self) -> int:
        """Prompt tokens still to compute (0 once transferring); the gateway balances P on it."""
        return 0 if self.phase >= JobPhase.TRANSFERRING else len(self.job.token_ids) - self.seq.num_computed_tokens
