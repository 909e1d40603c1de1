"""The real Backend: worker pools reached over ZeroMQ (protocol/serving.py records).

Life cycle of one request (one prompt, ``n`` completions) in the gateway:
1. admission: route it (gateway/workers/router.py) over accepting decode workers, minus those that said Busy
   for it and those whose circuit breaker is open. None registered -> NoCapacity (503). Registered but
   none with KV room -> wait in the decode pool's bounded queue (full or timed out -> NoCapacity).
2. send Generate(prefill_address = the chosen P's endpoint, or "" to prefill on D) to the decode worker.
3. wait for the first answer: Busy -> back to 1 without that worker; the worker lost (expired, restarted,
   said goodbye, unreachable) or an error before any token -> abort what it held, back to 1 without the
   worker to blame (at most ``max_retries`` times, within the deadline; counted as route result
   "retry"). Workers are left out by incarnation: one that restarted since is a new worker, and may
   take the retry (a decode worker restarted in place, the only one of its pool). A refusal (the
   client's request can never be served) is answered at once, blaming nobody.
   Who is blamed (its circuit breaker counts the failure): the worker that left; else the error event's
   ``culprit`` (protocol/serving.py): the decode worker itself, the prefill worker it relied on (the KV
   never came, came wrong, or the job could not be sent), or nobody (a deadline, a drain; the retry then
   avoids both workers of the attempt). A prefill worker's own error event blames it, whatever it says.
4. stream: TokenEvents (from P: offset 0; from D: the rest) are put back in order per completion
   (gateway/workers/completion_order.py) and handed to the HTTP layer; a worker lost now is an in-band error.
   Asked-for prompt logprobs arrive as PromptLogprobs frames before the first TokenEvent, from the
   same worker, and ride on every completion's first event.
5. end: every completion finished, an error, the deadline, or an abort (client gone, stop string) ->
   AbortRequest to the decode worker and the prefill worker it used, unless it finished by itself.

Several gateways may share the pools (docs/gateway-replicas.md): each worker heartbeats to each, and
this one acks every heartbeat with its id (``HeartbeatAck``, new per process), which its Generates
carry, so workers answer here and abort this gateway's requests if it dies. A worker's KV is its own
to reserve: a heartbeat's free blocks are a hint, and a worker that another gateway filled says Busy.

``ZmqBackend`` is that life cycle and the bookkeeping of the pools it draws on, read top to bottom (hence
its length); the sockets are the worker link's (worker_link.py), a request in flight and its records'
conversions are flight.py's, routing router.py's, breakers breaker.py's, the LoRA list lora_list.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

from gateway.deadline import get_by
from gateway.metrics import GatewayMetrics
from protocol.curve import PlaneSecurity
from protocol.endpoints import endpoint_error
from protocol.rejects import RejectLog
from protocol.serving import (
    AbortRequest,
    Busy,
    Generate,
    Goodbye,
    Heartbeat,
    HeartbeatAck,
    PromptLogprobs,
    TokenEvent,
    TokenEvents,
)

from .admission import AdmissionQueue
from .backend import Backend, CompletionEvent, GenerationRequest, NoCapacity
from .breaker import CircuitBreaker
from .completion_order import CompletionOrder
from .flight import Flight, WorkerGone, describe, to_backend_event, to_logprob
from .lora_list import ClusterLoRAList, stamp_of
from .registry import Role, WorkerRegistry
from .router import RouteDecision, Router, RouterParams
from .worker_link import WorkerLink

log = logging.getLogger("pdserve.gateway")
MAX_LORA_CHANGE_TRIES = 5  # a load or unload overtaken by other gateways' changes is made again, this often


@dataclass(slots=True)
class ZmqBackendParams:
    host: str  # interface of the worker ROUTER
    worker_port: int  # 0: any free port (tests)
    router: RouterParams
    max_queued_requests: int = 64  # decode pool admission queue bound
    queue_timeout_s: float = 5.0
    retry_after_s: int = 1
    max_retries: int = 2  # attempts after the first, for a request that failed before its first token
    default_timeout_s: float = 600.0  # deadline of a request that brings none
    max_frame_bytes: int = 1 << 20
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 10.0
    expiry_interval_s: float = 0.5  # how often silent workers are looked for
    security: PlaneSecurity | None = None  # CURVE keys of the worker plane; None: insecure (in-process tests)
    lora_load_timeout_s: float = 60.0  # /v1/load_lora_adapter waits this long for every worker
    lora_modules: dict[str, str] = field(default_factory=dict)  # the config's adapters (the workers' too)


class ZmqBackend(Backend):
    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics, params: ZmqBackendParams) -> None:
        self._registry = registry
        self._metrics = metrics
        self._params = params
        self._router = Router(registry, params.router)
        self._breaker = CircuitBreaker(params.breaker_threshold, params.breaker_cooldown_s)
        self._queue = AdmissionQueue(params.max_queued_requests)
        self._rejects = RejectLog(log, self._count_rejected)
        self._link = WorkerLink(
            params.host, params.worker_port, params.max_frame_bytes, self._on_record, self._rejects, params.security
        )
        self._flights: dict[str, Flight] = {}  # by request id
        self._by_wire_rid: dict[str, Flight] = {}  # by the current attempt's rid
        self.gateway_id = uuid.uuid4().hex  # workers tell gateway processes apart by it
        self._lora = ClusterLoRAList(params.lora_modules, params.security.key if params.security else None)
        self._expiry_task: asyncio.Task | None = None
        self._update_pool_gauges()

    @property
    def address(self) -> str:
        """The bound worker endpoint (tcp://host:port), once started."""
        return self._link.address

    # --- Backend interface -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._link.start()
        self._expiry_task = asyncio.create_task(self._expire_loop(), name="gateway-worker-expiry")
        log.info("worker link bound at %s", self.address)

    async def stop(self) -> None:
        for rid in list(self._flights):
            await self.abort(rid)
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            try:
                await self._expiry_task
            except asyncio.CancelledError:
                pass
        await self._link.close()

    def is_ready(self) -> bool:
        return bool(self._registry.accepting(Role.DECODE))

    def has_capacity(self) -> bool:
        # A full queue turns new arrivals away before tokenizing, but a queue of size 0 is always "full":
        # then nobody waits, and whether a worker has room right now is the router's call, not this one.
        return self.is_ready() and (self._queue.max_waiting == 0 or not self._queue.is_full)

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None and not flight.is_done:
            flight.is_aborted = True
            await self._abort_workers(flight, "aborted by the gateway")
            flight.events.put_nowait(None)  # wakes the generator, which ends

    async def generate(self, request: GenerationRequest):
        if request.request_id in self._flights:
            raise ValueError(f"request id {request.request_id} is already in flight")
        flight = Flight(request.request_id, len(request.prompt_token_ids), request.sampling.prompt_logprobs or 0)
        self._flights[flight.rid] = flight
        try:
            first = await self._place(request, flight)
            order = CompletionOrder(request.sampling.n)
            event = first
            queue_time: float | None = time.monotonic() - request.arrival_time
            while True:
                if not isinstance(event, TokenEvent):  # aborted, lost, deadline
                    if event is not None:
                        yield CompletionEvent(error=describe(event))
                    return
                if event.error:
                    # A refusal speaks to the client about its request; a failure names the worker.
                    error = event.error if event.refused else f"worker {flight.decode_worker}: {event.error}"
                    yield CompletionEvent(index=event.index, error=error, refused=event.refused)
                    return
                try:
                    released = order.push(event)
                except ValueError as e:
                    yield CompletionEvent(error=str(e))
                    return
                if order.is_finished:
                    # Before the last yield: a consumer that stops at the final event never resumes this
                    # generator, and its `finally` must not abort workers that finished by themselves.
                    flight.is_done = True
                for e in released:
                    out = to_backend_event(e, queue_time)
                    if queue_time is not None:  # the first event: who serves it (the request log line)
                        out.worker_ids = flight.workers()
                    queue_time = None
                    if e.offset == 0 and request.sampling.prompt_logprobs is not None:  # each completion's first
                        out.prompt_logprobs = flight.prompt_logprobs  # checked against the prompt by Generation
                    yield out
                if order.is_finished:
                    return  # the workers finished it themselves: nothing to abort
                event = await self._next(flight, request)
        finally:
            if not flight.is_done:
                await self._abort_workers(flight, "request ended in the gateway")
            del self._flights[flight.rid]
            self._by_wire_rid.pop(flight.wire_rid, None)
            self._queue.notify()  # its KV is about to be freed: queued requests may fit now

    # --- placement: route, send, wait for the first answer ------------------------------------------

    async def _place(self, request: GenerationRequest, flight: Flight):
        """Returns the first TokenEvent (or a terminal record to turn into an error); raises NoCapacity."""
        policy = self._params.router.policy.value
        tried: dict[str, str] = {}  # worker id -> the incarnation that said Busy for this request, or failed it
        retries_left = self._params.max_retries
        failure = None  # the last attempt's failure: what the client hears if no retry is possible
        while True:
            routing_started_ns = time.time_ns() if request.trace else 0
            try:
                decision = await self._route(request, self._still_tried(tried))
            except NoCapacity:
                if failure is not None:
                    return failure
                raise
            self._by_wire_rid.pop(flight.wire_rid, None)  # frames of an earlier attempt are late from now on
            flight.wire_rid = flight.rid if flight.num_attempts == 0 else f"{flight.rid}~{flight.num_attempts}"
            flight.num_attempts += 1
            self._by_wire_rid[flight.wire_rid] = flight
            flight.decode_worker, flight.prefill_worker = decision.decode_worker, decision.prefill_worker
            incarnations = {w: self._incarnation(w) for w in flight.workers()}  # of this attempt's workers
            if request.trace:
                request.trace.span(
                    "route",
                    routing_started_ns,
                    decode_worker=decision.decode_worker,
                    prefill_worker=decision.prefill_worker or "",
                    cached_tokens=decision.prefill_cached_tokens,
                )
            flight.events, flight.prompt_logprobs = asyncio.Queue(), []  # nothing left from an earlier attempt
            prefill = self._registry.get(decision.prefill_worker) if decision.prefill_worker else None
            generate = Generate(
                flight.wire_rid,
                request.prompt_token_ids,
                request.sampling,
                prefill.address if prefill is not None else "",
                self._wall_deadline(request),
                request.trace.traceparent() if request.trace else "",
                self.gateway_id,
                prefill_key=self._link.peer_of(prefill.worker_id) if prefill is not None else "",
            )
            # Until the first answer the prompt counts on its P's backlog (the router's local-prefill rule).
            backlog = len(request.prompt_token_ids) - decision.prefill_cached_tokens if prefill is not None else 0
            if backlog:
                self._router.prefill_sent(prefill.worker_id, backlog)
            try:
                if await self._link.send(decision.decode_worker, generate):
                    answer = await self._next(flight, request)
                else:
                    answer = WorkerGone(decision.decode_worker, "not connected")
            finally:
                if backlog:
                    self._router.prefill_done(prefill.worker_id, backlog)
            if isinstance(answer, TokenEvent) and not answer.error:
                for worker_id in flight.workers():
                    self._breaker.record_success(worker_id)
                    self._metrics.worker_breaker_open.labels(worker_id).set(0)
                return answer
            if isinstance(answer, Busy):
                self._metrics.route_decisions.labels(policy, "busy").inc()
                tried[decision.decode_worker] = incarnations[decision.decode_worker]
                flight.decode_worker = flight.prefill_worker = None  # a Busy worker kept nothing
                continue
            if answer is None or (isinstance(answer, WorkerGone) and answer.reason == "deadline"):
                return answer  # aborted or out of time: nothing to retry
            if isinstance(answer, TokenEvent) and answer.refused:
                return answer  # the client's request, not a worker, is at fault: no retry helps
            failed = self._blamed(answer, decision)
            if failed is not None and self._incarnation(failed) == incarnations.get(failed, ""):
                self._record_failure(failed)  # (not one that restarted or left since: a new worker)
            await self._abort_workers(flight, f"attempt failed: {describe(answer)}")
            if flight.is_aborted:
                return None
            flight.is_done = False  # the request itself goes on
            if retries_left == 0 or (request.deadline is not None and time.monotonic() >= request.deadline):
                return answer
            retries_left -= 1
            for worker_id in [failed] if failed is not None else incarnations:  # nobody's fault: avoid both
                tried[worker_id] = incarnations.get(worker_id, "")
            failure = answer
            self._metrics.route_decisions.labels(policy, "retry").inc()
            log.warning("request %s: %s before the first token; retrying elsewhere", flight.rid, describe(answer))

    @staticmethod
    def _blamed(answer, decision: RouteDecision) -> str | None:
        """The worker an attempt's failure counts against; None when it is nobody's fault."""
        if isinstance(answer, WorkerGone):
            return answer.worker_id
        # An error event, its culprit checked on receipt (_on_record): "prefill" only with a prefill worker.
        return {"decode": decision.decode_worker, "prefill": decision.prefill_worker}.get(answer.culprit)

    def _record_failure(self, worker_id: str) -> None:
        now = time.monotonic()
        self._breaker.record_failure(worker_id, now)
        self._metrics.worker_failures.labels(worker_id).inc()
        if self._breaker.is_open(worker_id, now):
            log.warning(
                "worker %s failed %d times in a row: no requests for it for a while",
                worker_id,
                self._params.breaker_threshold,
            )
            self._metrics.worker_breaker_open.labels(worker_id).set(1)

    def _update_breaker_gauges(self) -> None:
        """Breakers whose cooldown ended read closed again (a failure at the next try reopens them)."""
        open_now = self._breaker.open_workers(time.monotonic())
        for worker_id in self._breaker.tripped():
            if worker_id not in open_now:
                self._metrics.worker_breaker_open.labels(worker_id).set(0)

    def _incarnation(self, worker_id: str) -> str:
        """The registered incarnation of ``worker_id``; "" when it is not registered."""
        info = self._registry.get(worker_id)
        return info.incarnation if info is not None else ""

    def _still_tried(self, tried: dict[str, str]) -> set[str]:
        """The workers to leave out: those tried, unless they restarted since (a new incarnation)."""
        return {w for w, incarnation in tried.items() if self._incarnation(w) in (incarnation, "")}

    async def _route(self, request: GenerationRequest, tried: set[str]) -> RouteDecision:
        """A decision, waiting in the admission queue while workers exist but lack KV room."""
        policy = self._params.router.policy.value
        give_up = time.monotonic() + self._params.queue_timeout_s
        while True:
            excluded = tried | self._breaker.open_workers(time.monotonic())
            spec = request.sampling
            decision = self._router.route(
                request.prompt_token_ids,
                frozenset(excluded),
                spec.computes_whole_prompt,
                prefill_on_decode=spec.prefills_on_decode,
                cache_salt=spec.cache_salt,
                lora_name=spec.lora_name,
                lora_path=spec.lora_path,
            )
            if decision is not None:
                result = "local" if decision.prefill_worker is None else "disaggregated"
                self._metrics.route_decisions.labels(policy, result).inc()
                return decision
            candidates = [w for w in self._registry.accepting(Role.DECODE) if w.worker_id not in excluded]
            if not candidates:
                self._metrics.route_decisions.labels(policy, "no_capacity").inc()
                why = "every decode worker is busy" if tried else "no decode worker is available"
                raise NoCapacity(self._params.retry_after_s, why)
            if self._queue.is_full:
                self._metrics.route_decisions.labels(policy, "queue_full").inc()
                raise NoCapacity(
                    self._params.retry_after_s, f"the decode pool's queue is full ({self._queue.max_waiting} waiting)"
                )
            remaining = give_up - time.monotonic()
            if request.deadline is not None:
                remaining = min(remaining, request.deadline - time.monotonic())
            self._metrics.admission_queue.labels(Role.DECODE.value).inc()
            try:
                woken = remaining > 0 and await self._queue.wait(remaining)
            finally:
                self._metrics.admission_queue.labels(Role.DECODE.value).dec()
            if not woken:
                self._metrics.route_decisions.labels(policy, "no_capacity").inc()
                raise NoCapacity(self._params.retry_after_s, "no decode worker had KV room in time")

    async def _next(self, flight: Flight, request: GenerationRequest):
        """The next record for ``flight``; WorkerGone(reason="deadline") when the deadline passes first."""
        try:
            return await get_by(flight.events, request.deadline)
        except TimeoutError:
            return WorkerGone(flight.decode_worker or "", "deadline")

    async def _abort_workers(self, flight: Flight, reason: str) -> None:
        flight.is_done = True
        for worker_id in flight.workers():
            await self._link.send(worker_id, AbortRequest(flight.wire_rid, reason))

    def _wall_deadline(self, request: GenerationRequest) -> float:
        """The request's monotonic deadline on the wall clock, which other hosts share."""
        if request.deadline is None:
            return time.time() + self._params.default_timeout_s
        return time.time() + (request.deadline - time.monotonic())

    # --- records from workers ---------------------------------------------------------------------

    def _on_record(self, worker_id: str, record) -> None:
        if isinstance(record, Heartbeat):
            self._on_heartbeat(worker_id, record)
        elif isinstance(record, Goodbye):
            if record.worker_id != worker_id:
                self._on_malformed(f"goodbye for {record.worker_id[:64]!r} from {worker_id[:64]!r}")
            elif self._registry.remove(worker_id):
                self._metrics.workers_lost.labels("goodbye").inc()
                self._worker_left(worker_id, "said goodbye")
        elif isinstance(record, TokenEvents):
            for event in record.events:
                self._on_request_record(worker_id, event)
        else:
            self._on_request_record(worker_id, record)

    def _on_request_record(self, worker_id: str, record) -> None:
        """TokenEvent, PromptLogprobs or Busy: only the workers serving the request may speak for it."""
        flight = self._by_wire_rid.get(record.rid)
        if flight is None or flight.is_done:
            return  # finished or aborted already; late records are expected
        if worker_id == flight.decode_worker or (
            isinstance(record, (TokenEvent, PromptLogprobs)) and worker_id == flight.prefill_worker
        ):
            if isinstance(record, TokenEvent) and record.error:
                self._check_culprit(worker_id, flight, record)
            if isinstance(record, PromptLogprobs):
                self._add_prompt_logprobs(worker_id, flight, record)
            else:
                flight.events.put_nowait(record)
        else:
            self._rejects.reject(
                "not_assigned",
                worker_id,
                f"{type(record).__name__} for {flight.rid[:64]}, a request it does not serve",
            )

    def _check_culprit(self, worker_id: str, flight: Flight, event: TokenEvent) -> None:
        """Set ``event.culprit`` to whom the failure counts against: "decode", "prefill" or "none". A
        worker speaks for itself ("" is the sender); a decode worker may blame the prefill worker its
        request used, or nobody; a prefill worker cannot blame anyone else."""
        sender = "decode" if worker_id == flight.decode_worker else "prefill"
        claimed = event.culprit or sender
        if event.refused:
            claimed = "none"
        elif sender == "prefill" or (claimed == "prefill" and flight.prefill_worker is None):
            if claimed != sender:
                self._rejects.reject(
                    "invalid_value", worker_id, f"error event for {flight.rid[:64]} blames {claimed!r}, not itself"
                )
            claimed = sender
        event.culprit = claimed

    def _add_prompt_logprobs(self, worker_id: str, flight: Flight, frame: PromptLogprobs) -> None:
        have = flight.prompt_logprobs
        if have is None:
            return  # already failed
        if frame.start != len(have) or len(have) + len(frame.logprobs) > flight.num_prompt_tokens - 1:
            # A gap, a repeat or more than the prompt has: counted, and the request fails at its first
            # token (Generation checks the prompt logprobs against the prompt); nothing piles up here.
            flight.prompt_logprobs = None
            self._on_malformed(
                f"prompt logprobs for {flight.rid[:64]} from {worker_id[:64]!r}: entries "
                f"{frame.start}..{frame.start + len(frame.logprobs)} for a prompt of "
                f"{flight.num_prompt_tokens} tokens, {len(have)} received"
            )
            return
        k = flight.num_top_prompt_logprobs
        have += [to_logprob(r, rank, k) for r, rank in zip(frame.logprobs, frame.ranks)]

    def _on_heartbeat(self, worker_id: str, hb: Heartbeat) -> None:
        if hb.worker_id != worker_id:
            self._on_malformed(f"heartbeat for {hb.worker_id[:64]!r} from {worker_id[:64]!r}")
            return
        if error := endpoint_error(hb.address):  # decode workers would be sent to it
            self._rejects.reject("invalid_value", worker_id, f"heartbeat address: {error}")
            return
        self._link.send_nowait(worker_id, HeartbeatAck(self.gateway_id))
        known = self._registry.get(worker_id)
        if known is not None and known.incarnation != hb.incarnation:
            self._worker_left(worker_id, "restarted")  # its in-flight requests died with the old process
        if known is None:
            log.info("worker %s (%s) registered at %s", worker_id, hb.role, hb.address)
        self._registry.observe(hb, time.monotonic())
        if self._lora.observe(hb):  # joined later, or restarted: send it the cluster's list
            self._send_lora_set(worker_id, hb.incarnation)
        self._update_pool_gauges()
        self._queue.notify()

    def lora_adapters(self) -> dict[str, str]:
        return self._lora.paths()

    async def change_lora_adapters(self, name: str, path: str | None) -> str:
        give_up = time.monotonic() + self._params.lora_load_timeout_s
        for _ in range(MAX_LORA_CHANGE_TRIES):
            paths = dict(self._lora.paths())
            if path is None:
                paths.pop(name, None)
            else:
                paths[name] = path
            mine = self._lora.make(paths, self.gateway_id)
            workers = self._registry.workers()
            for w in workers:
                self._send_lora_set(w.worker_id, w.incarnation)
            while time.monotonic() < give_up:
                current = [w for w in (self._registry.get(x.worker_id) for x in workers) if w is not None]
                if errors := [
                    e
                    for w in current
                    if stamp_of(w.heartbeat) == mine.stamp
                    for e in w.heartbeat.lora_errors
                    if e.startswith(f"{name}: ")
                ]:
                    return f"worker: {errors[0][len(name) + 2 :]}"
                if all(stamp_of(w.heartbeat) >= mine.stamp for w in current):
                    break
                await asyncio.sleep(0.05)
            else:
                late = [
                    w.worker_id
                    for w in workers
                    if (x := self._registry.get(w.worker_id)) and stamp_of(x.heartbeat) < mine.stamp
                ]
                within = self._params.lora_load_timeout_s
                return f"workers {', '.join(late)} did not apply the adapter list within {within:g} s"
            # Applied, or overtaken by another gateway's change made at the same time: done if the
            # newest list has this change in it, else it is made again on top of that list.
            if self._lora.paths().get(name) == path:
                return ""
        return f"the adapter list kept changing through other gateways ({MAX_LORA_CHANGE_TRIES} tries)"

    def _send_lora_set(self, worker_id: str, incarnation: str) -> None:
        if self._lora.due(worker_id, incarnation):  # else on its way; the worker's next heartbeat reports it
            asyncio.ensure_future(self._link.send(worker_id, self._lora.newest))

    def _on_malformed(self, why: str, worker_id: str = "") -> None:
        self._rejects.reject("malformed", worker_id, why)

    def _count_rejected(self, reason: str) -> None:
        self._metrics.rejected_frames.labels(reason).inc()
        if reason == "malformed":
            self._metrics.worker_malformed_frames.inc()

    def _worker_left(self, worker_id: str, reason: str) -> None:
        log.warning("worker %s left: %s", worker_id, reason)
        if reason != "restarted":  # a restarted worker is registered again under its new key already
            self._link.unbind(worker_id)
        self._router.forget([worker_id])
        self._lora.forget(worker_id)
        self._breaker.forget(worker_id)
        for gauge in (self._metrics.worker_breaker_open, self._metrics.worker_failures):
            with contextlib.suppress(KeyError):  # never failed
                gauge.remove(worker_id)
        for flight in self._flights.values():
            if not flight.is_done and worker_id in flight.workers():
                flight.events.put_nowait(WorkerGone(worker_id, reason))
        self._update_pool_gauges()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._params.expiry_interval_s)
            for worker_id in self._registry.expire(time.monotonic()):
                self._metrics.workers_lost.labels("expired").inc()
                self._worker_left(worker_id, "heartbeats stopped")
            self._check_stuck()
            self._update_breaker_gauges()

    def _check_stuck(self) -> None:
        """A worker alive (heartbeating) but in one step past the step timeout is wedged: it takes nothing
        new, and what it holds fails now, retried elsewhere before the first token; it is aborted there
        too, for when the step ends. A step that ends puts the worker back in rotation."""
        now = time.monotonic()
        stuck, recovered = self._registry.check_stuck(now)
        for worker_id in stuck:
            info = self._registry.get(worker_id)
            age, limit = info.step_age(now), self._registry.step_timeout_s
            reason = f"is stuck: one step has run for {age:.0f} s (gateway.worker_step_timeout_s is {limit:g} s)"
            log.error("worker %s %s: out of rotation, its requests failed", worker_id, reason)
            self._metrics.workers_stuck.inc()
            for flight in self._flights.values():
                if not flight.is_done and worker_id in flight.workers():
                    flight.events.put_nowait(WorkerGone(worker_id, reason))
        for worker_id in recovered:
            log.warning("worker %s: its stuck step ended; back in rotation", worker_id)
        if stuck or recovered:
            self._update_pool_gauges()
            self._queue.notify()

    def _update_pool_gauges(self) -> None:
        m = self._metrics
        for role in Role:
            workers = self._registry.workers(role)
            total = sum(w.heartbeat.kv_blocks_total for w in workers)
            m.pool_workers.labels(role.value).set(len(workers))
            m.pool_kv_cache_usage.labels(role.value).set(
                sum(w.heartbeat.kv_blocks_in_use for w in workers) / total if total else 0.0
            )
            m.pool_requests_running.labels(role.value).set(sum(w.heartbeat.num_running for w in workers))
            m.pool_requests_waiting.labels(role.value).set(sum(w.heartbeat.num_waiting for w in workers))
