"""Choosing a decode worker (D) and a prefill worker (P) for a prompt; pure logic over the registry.

Policies for D:
- round_robin: the next decode worker in id order.
- least_loaded: the fewest KV blocks in use, then the fewest requests.
- prefix (default): the longest known prefix hit, then least loaded. The gateway cannot see worker caches;
  it remembers the block hashes it sent to each worker (bounded, LRU), which is what a worker most likely
  still caches. A worker restart (new incarnation) forgets them.

Disaggregation: the prompt's uncached suffix on D goes to the P expected to finish it first: the
smallest backlog plus the prompt tokens it would compute (those past its tracked prefix hit), as
Dynamo's KV router weighs load against overlap; then the longer hit, then the id. A hit alone must not
decide: a P that rejoins or is added holds no tracked prefix and would get nothing while another P holds
them all, however backed up that one is. D prefills the suffix itself only when no prefill worker
exists, when it fits in one block (and in ``local_prefill_max_tokens``; 0 sends everything to P), or
when it is short (<= ``local_prefill_max_tokens``) and every P is backed up by more than that many
tokens: there it would wait longer than D takes to compute it. An idle P always takes it, so D's decode
steps stay steady (a 256-token prefill on a CPU decode worker stalls every running stream for a quarter
of a second).

A P's backlog is the larger of the queued prefill tokens in its last heartbeat (every gateway's work,
up to a heartbeat old) and the uncached tokens this gateway sent it that have not produced a first
token yet (``prefill_sent`` / ``prefill_done``: exact, and current between heartbeats).

    prompt tokens:  [ cached on D | uncached suffix ............................ ]
                                    \\_ on P; on D if short and every P is busy _/
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from protocol.hashing import block_hashes, lora_identity

from .registry import Role, WorkerInfo, WorkerRegistry


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"


@dataclass(slots=True)
class RouterParams:
    block_size: int  # must equal the workers' KV block size, or hashes never match
    policy: Policy = Policy.PREFIX
    local_prefill_max_tokens: int = 256  # uncached suffixes up to this are prefilled on D itself
    max_tracked_blocks: int = 100_000  # per worker; oldest forgotten first

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.local_prefill_max_tokens >= 0 and self.max_tracked_blocks > 0


@dataclass(slots=True)
class RouteDecision:
    decode_worker: str
    prefill_worker: str | None  # None: D prefills the prompt itself
    decode_cached_tokens: int  # prompt tokens expected to hit D's prefix cache
    prefill_cached_tokens: int  # prompt tokens expected to hit P's prefix cache (0 when local)


class _TrackedBlocks:
    """Block hashes last sent to one worker, LRU-bounded, valid for one incarnation."""

    __slots__ = ("incarnation", "_hashes", "_limit")

    def __init__(self, incarnation: str, limit: int) -> None:
        self.incarnation = incarnation
        self._hashes: OrderedDict[int, None] = OrderedDict()
        self._limit = limit

    def num_prefix_hits(self, hashes: list[int]) -> int:
        hits = 0
        for h in hashes:  # chained hashes: the first miss ends the shared prefix
            if h not in self._hashes:
                break
            hits += 1
        return hits

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._limit:
            self._hashes.popitem(last=False)


class Router:
    def __init__(self, registry: WorkerRegistry, params: RouterParams) -> None:
        self._registry = registry
        self._params = params
        self._tracked: dict[str, _TrackedBlocks] = {}
        self._next_rr = 0
        self._sent_prefill_tokens: dict[str, int] = {}  # P -> uncached tokens sent, no first token yet

    def route(
        self,
        prompt_ids: list[int],
        exclude: frozenset[str] = frozenset(),
        whole_prompt: bool = False,
        prefill_on_decode: bool = False,
        cache_salt: str = "",
        lora_name: str = "",
        lora_path: str = "",
    ) -> RouteDecision | None:
        """Where to run ``prompt_ids``; None when no decode worker has KV room for it (answer 503).

        ``exclude`` holds workers not to use (said Busy for this request, failed, or circuit-broken);
        draining workers are never chosen. ``whole_prompt``: the workers compute every prompt token
        whatever they cache (prompt logprobs), so no prefix hit counts; ``prefill_on_decode``: D
        prefills it itself (prompt logprobs with n > 1); ``cache_salt``, ``lora_name`` and ``lora_path``: the
        request's, which its blocks' hashes carry on the workers too. Only workers whose heartbeat lists the LoRA
        adapter take the request; among equal prefix hits, one that holds it in a device slot is first."""
        bs = self._params.block_size
        hashes = block_hashes(prompt_ids, bs, cache_salt, lora_identity(lora_name, lora_path))
        hit_hashes = [] if whole_prompt else hashes
        num_blocks_needed = -(-(len(prompt_ids) + 1) // bs)  # the prompt plus the first generated token
        decoders = [
            w
            for w in self._registry.accepting(Role.DECODE)
            if w.worker_id not in exclude and w.kv_blocks_free >= num_blocks_needed and _serves(w, lora_name)
        ]
        if not decoders:
            return None
        d = self._pick_decode(decoders, hit_hashes, lora_name)
        d_cached = self._hits(d, hit_hashes) * bs
        uncached = len(prompt_ids) - d_cached
        prefillers = [
            w for w in self._registry.accepting(Role.PREFILL) if w.worker_id not in exclude and _serves(w, lora_name)
        ]
        local_max = self._params.local_prefill_max_tokens
        # Within one block a suffix adds less to D's step than the round trip through a P would cost.
        tiny = uncached <= min(bs, local_max)
        busy = uncached <= local_max and min(map(self.backlog, prefillers), default=0) > local_max
        if not prefillers or tiny or busy or prefill_on_decode:
            decision = RouteDecision(d.worker_id, None, d_cached, 0)
        else:
            p = min(prefillers, key=lambda w: self._prefill_cost(w, prompt_ids, hit_hashes, lora_name))
            decision = RouteDecision(d.worker_id, p.worker_id, d_cached, self._hits(p, hit_hashes) * bs)
        self._record(decision, hashes)
        return decision

    def _pick_decode(self, decoders: list[WorkerInfo], hashes: list[int], lora_name: str) -> WorkerInfo:
        policy = self._params.policy
        if policy is Policy.ROUND_ROBIN:
            chosen = decoders[self._next_rr % len(decoders)]
            self._next_rr += 1
            return chosen
        if policy is Policy.LEAST_LOADED:
            return min(decoders, key=lambda w: (_cold(w, lora_name), *_load_key(w)))
        return min(decoders, key=lambda w: (-self._hits(w, hashes), _cold(w, lora_name), *_load_key(w)))

    def _prefill_cost(self, prefiller: WorkerInfo, prompt_ids: list[int], hashes: list[int], lora_name: str) -> tuple:
        hit_tokens = self._hits(prefiller, hashes) * self._params.block_size
        return (
            self.backlog(prefiller) + len(prompt_ids) - hit_tokens,
            -hit_tokens,
            _cold(prefiller, lora_name),
            prefiller.worker_id,
        )

    def _tracked_for(self, worker: WorkerInfo) -> _TrackedBlocks:
        tracked = self._tracked.get(worker.worker_id)
        if tracked is None or tracked.incarnation != worker.incarnation:  # restarted: its cache is empty
            # The worker caches at most its pool's blocks: a hash older than the newest kv_blocks_total
            # sent to it can only predict a hit that is not there, and kept it would grow the gateway by
            # ~100 bytes per block up to max_tracked_blocks (found by the soak, tests/soak.py).
            limit = min(self._params.max_tracked_blocks, worker.heartbeat.kv_blocks_total)
            tracked = _TrackedBlocks(worker.incarnation, limit)
            self._tracked[worker.worker_id] = tracked
        return tracked

    def _hits(self, worker: WorkerInfo, hashes: list[int]) -> int:
        return self._tracked_for(worker).num_prefix_hits(hashes)

    def _record(self, decision: RouteDecision, hashes: list[int]) -> None:
        for worker_id in (decision.decode_worker, decision.prefill_worker):
            if worker_id is not None:
                self._tracked_for(self._registry.get(worker_id)).add(hashes)

    def backlog(self, prefiller: WorkerInfo) -> int:
        """Prefill tokens waiting on a P, as far as this gateway knows (see the module docstring)."""
        sent = self._sent_prefill_tokens.get(prefiller.worker_id, 0)
        return max(prefiller.heartbeat.queued_prefill_tokens, sent)

    def prefill_sent(self, worker_id: str, num_tokens: int) -> None:
        self._sent_prefill_tokens[worker_id] = self._sent_prefill_tokens.get(worker_id, 0) + num_tokens

    def prefill_done(self, worker_id: str, num_tokens: int) -> None:
        """The P answered (first token or failure) or the request ended: its tokens are off the backlog."""
        left = self._sent_prefill_tokens.get(worker_id, 0) - num_tokens
        if left > 0:
            self._sent_prefill_tokens[worker_id] = left
        else:
            self._sent_prefill_tokens.pop(worker_id, None)

    def forget(self, worker_ids: list[str]) -> None:
        """Drop what is known about workers that left the registry."""
        for worker_id in worker_ids:
            self._tracked.pop(worker_id, None)
            self._sent_prefill_tokens.pop(worker_id, None)


def _serves(w: WorkerInfo, lora_name: str) -> bool:
    """The worker has the request's LoRA adapter loaded (every worker serves the base)."""
    return not lora_name or lora_name in w.heartbeat.lora_names


def _cold(w: WorkerInfo, lora_name: str) -> bool:
    """The adapter is not in one of the worker's device slots: its first step there pages it in."""
    return bool(lora_name) and lora_name not in w.heartbeat.hot_lora_names


def _load_key(w: WorkerInfo) -> tuple:
    return (w.kv_usage, w.num_requests, w.worker_id)
