"""What this node tells others of its load: the engine snapshot behind /metrics, and the Heartbeat that
registers it with every gateway and feeds the router (KV headroom, queues, prefill work still to do here).
"""

from __future__ import annotations

from collections.abc import Iterable

from decode_node.request_state import DecodeRequest, Phase
from engine.kv.block_manager import BlockManager
from engine.sched.scheduler import Scheduler
from protocol.serving import Heartbeat
from worker import EngineSnapshot


def engine_snapshot(scheduler: Scheduler, bm: BlockManager, requests: Iterable[DecodeRequest]) -> EngineSnapshot:
    awaiting = sum(r.phase <= Phase.AWAITING_KV for r in requests)  # and COMPILING: not in the engine yet
    return EngineSnapshot.read(scheduler, bm, num_waiting_outside=awaiting)


def queued_prefill_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens this node still has to compute itself: waiting prompts, and running ones mid-prefill."""
    queued = sum(s.num_uncomputed_tokens for s in scheduler.waiting)
    return queued + sum(s.num_uncomputed_tokens - 1 for s in scheduler.running if s.num_uncomputed_tokens > 1)


def decode_heartbeat(snap: EngineSnapshot, queued_tokens: int, draining: bool, **identity) -> Heartbeat:
    """``identity``: worker_id, address, incarnation, proof and the LoRA list fields (the caller's)."""
    return Heartbeat(
        role="decode",
        block_size=snap.block_size,
        kv_blocks_total=snap.kv_blocks_total,
        kv_blocks_free=snap.kv_blocks_free,
        kv_blocks_in_use=snap.kv_blocks_in_use,
        num_running=snap.num_running,
        num_waiting=snap.num_waiting,
        queued_prefill_tokens=queued_tokens,
        draining=draining,
        **identity,
    )
