"""The prefill worker: chunked prefill for decode workers, KV pushed to them chunk by chunk.

Life cycle of a request on this node:
1. A decode worker sends ``PrefillJob{rid, token_ids, skip, dst blocks, generation, kv_address}`` to
   our ROUTER. It is validated (vocabulary, block counts, deadline, sampling); a bad job is answered
   ``PrefillFailed`` at once and counted, and the node keeps serving.
2. The job queues until the blocks for its whole prompt fit under the admission budget (so the
   scheduler never preempts a prefill whose blocks already went out), then becomes a Sequence with
   ``max_tokens = 1`` in the engine's scheduler (with its grammar's matcher for a structured output,
   compiled on the grammar thread while the job waits: other jobs may go first; a grammar that does
   not compile fails the job). The block manager reuses this node's prefix cache.
3. Each step (one per loop turn) runs chunks of many jobs under the per-step token budget. After
   ``runner.execute`` and before ``postprocess`` frees finished sequences, the blocks each job
   finished that D lacks (index >= skip // block_size) are queued on the KV sender for its
   ``kv_address`` (handshake once per receiver incarnation), mapped onto the job's dst block ids.
4. On the last chunk the partial tail block goes out too; the job's blocks are pinned (held until
   the transfer ends); with ``sample_first`` the first token goes to the gateway as
   ``TokenEvent(index 0, offset 0)`` at once (TTFT) and rides in the transfer's ``Commit``; prompt
   logprobs, when asked, go to the gateway just before it (``PromptLogprobs`` frames).
5. The receiver's ``CommitAck`` ends the job: the pin is dropped (full blocks stay in the prefix
   cache). A failed transfer (receiver gone, deadline, rejected write) unpins at once and answers
   ``PrefillFailed`` to D if it is reachable; one D refused as stale (it released the range: aborted,
   expired or retried) is an abort, whichever of the refusal and D's ``AbortRequest`` arrives first.
6. ``AbortRequest`` (from D or the gateway) at any phase — queued, prefilling, transferring — frees
   everything here and aborts the transfer. Past its deadline a job fails the same way.
Around it: a Heartbeat to every gateway every interval (queued prefill tokens, KV block counts, how far
the loop has got), repeated by a thread of its own while a step runs long (worker/liveness.py); a
gateway that stops acking them (worker/gateway_links.py) takes its jobs with it, aborted as in 6.
/metrics, /health, /ready, and SIGTERM drain (no new jobs, finish in-flight, Goodbye, exit).
This file is that life cycle, one group of methods per step, read top to bottom (hence its length);
what is not lives beside it: a job's checks (job_check.py) and state (job.py), the blocks to push
(block_push.py) and their pins (block_pins.py), the KV senders per decode worker (kv_senders.py), the
first token's sampling (sampling.py), metrics and options.
Every socket is CURVE-authenticated with the cluster key (protocol/curve.py). A frame that fails to
decode or validate is refused and counted (``pdserve:rejected_frames_total{reason}``); one whose handling
raises is counted as ``handler_error``, its job failed, and the loop goes on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid

import zmq

from engine.kv.block_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.lora.sync import LoRASync
from engine.sampling.structured_output import StructuredOutputError
from engine.sched.batch import ScheduledBatch
from engine.sched.scheduler import AdmissionError
from engine.sched.sequence import Sequence
from kvtransfer.events import TransferEvent
from kvtransfer.sender import HandshakeError
from prefill_node.block_pins import BlockPins
from prefill_node.block_push import blocks_to_push
from prefill_node.job import JobPhase, JobState
from prefill_node.job_check import JobLimits, check_job
from prefill_node.kv_senders import KVSenders
from prefill_node.metrics import PrefillMetrics
from prefill_node.options import PrefillOptions
from prefill_node.sampling import first_token_params
from protocol.codec import WireError, decode, encode
from protocol.curve import PlaneSecurity
from protocol.rejects import RejectLog
from protocol.serving import AbortRequest, Heartbeat, LoRAAdapterSet, PrefillFailed, PrefillJob, TokenEvent
from protocol.zmq_util import bind, make_socket
from telemetry.tracing import NO_TRACING, Tracer
from worker.drain import Drain
from worker.gateway_links import GatewayLinks
from worker.heartbeat import HeartbeatTimer
from worker.liveness import Liveness, StepWatch
from worker.logprob_records import logprob_record, prompt_logprobs_frames

log = logging.getLogger(__name__)

# Whose fault a failed job is, by its jobs_rejected label, unless the call names another: a job the
# decode worker got wrong, or its KV receiver that did not answer, refused us or restarted, is the decode
# worker's; the deadline and a drain are nobody's.
CULPRIT_OF_LABEL = {
    "bad_job": "decode",
    "handshake": "decode",
    "transfer": "decode",
    "deadline": "none",
    "draining": "none",
}


class PrefillServer:
    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        ctx: zmq.Context,
        options: PrefillOptions,
        metrics: PrefillMetrics,
        security: PlaneSecurity | None = None,
        tracer: Tracer = NO_TRACING,
    ):
        security = security or PlaneSecurity(None)
        self.security = security
        self.rejects = RejectLog(log, metrics.transfer.count_rejected)
        self.options = options
        self.tracer = tracer
        self.scheduler = engine.scheduler
        self.runner = engine.runner
        self.new_guide_async = engine.new_guide_async  # a structured output's matcher, compiled off the loop
        self.lora_error = engine.lora_error  # why a job's LoRA adapter cannot run here ("" when it can)
        self.block_manager = engine.scheduler.block_manager
        self.metrics = metrics
        bm, cfg = self.block_manager, engine.model_config
        self.limits = JobLimits(cfg.vocab_size, bm.block_size, bm.num_blocks, self.scheduler.config.max_model_len)
        self._eos_token_ids = list(cfg.eos_token_ids)
        self.router = security.server(make_socket(ctx, zmq.ROUTER, hwm=1024, max_msg_size=options.max_frame_bytes))
        self.address = bind(self.router, options.host, options.port)  # our endpoint in heartbeats
        self.gateway = GatewayLinks(
            ctx,
            options.gateway_address,
            options.worker_id,
            accepted=(AbortRequest, LoRAAdapterSet),
            timeout_s=options.gateway_timeout_s,
            resolve_interval_s=options.heartbeat_s,
            security=security,
        )
        self.lora_sync = LoRASync(engine.runner.lora)
        self.senders = KVSenders(
            ctx,
            self.runner.kv_pool,
            model_name,
            metrics.transfer,
            transports=options.transports,
            deadline_s=options.transfer_deadline_s,
            handshake_timeout_s=options.handshake_timeout_s,
            max_frame_bytes=options.max_frame_bytes,
            security=security,
        )
        self.pins = BlockPins(bm)
        self.incarnation = uuid.uuid4().hex
        self.jobs: dict[str, JobState] = {}  # every live job, any phase
        self._queue: collections.deque[JobState] = collections.deque()  # not yet admitted
        self._by_seq: dict[int, JobState] = {}  # seq_id -> job, for jobs in the scheduler
        self._seq_ids = itertools.count()
        self._heartbeat = HeartbeatTimer(options.heartbeat_s)
        self.liveness = Liveness(self.gateway, options.heartbeat_s, StepWatch(), stuck_after_s=options.step_timeout_s)
        self._stop = threading.Event()
        self._drain = Drain(options.drain_timeout_s)
        self.is_done = False  # drained and said Goodbye

    # ---- the loop ----
    def serve_forever(self) -> None:
        """Run until ``stop()`` or a finished drain; closes the sockets on the way out."""
        try:
            self.liveness.start(self.heartbeat())
            while not self._stop.is_set() and not self.is_done:
                with self.liveness.watch.step():
                    self.run_once()
        finally:
            self.liveness.stop()
            self.close()

    def run_once(self, timeout_ms: int | None = None) -> None:
        """One loop turn: take messages (waiting only when idle), run a step, pump transfers."""
        if timeout_ms is None:
            timeout_ms = self._poll_timeout_ms()
        self._receive(timeout_ms)
        self._expire()
        self._admit()
        batch = self.scheduler.schedule()
        if batch is not None:
            self._step(batch)
        self._on_transfer_events(self.senders.poll())
        self._after_turn()

    def _poll_timeout_ms(self) -> int:
        """0 with compute to do. Else sleep on the sockets: jobs waiting for a handshake, for blocks or for
        their transfer are woken by a reply (HandshakeReply, Credit, CommitAck); only a grammar compiling
        (a future) or a message a socket refused needs a look every millisecond."""
        if self.scheduler.has_unfinished():
            return 0
        compiling = any(s.guide is not None for s in self._queue)
        return 1 if compiling or self.senders.wait_on_time() else self.options.idle_poll_ms

    def stop(self) -> None:
        """Thread-safe: ask ``serve_forever`` to return."""
        self._stop.set()

    def request_drain(self) -> None:
        """SIGTERM (signal-safe, a flag): take no new jobs, finish in-flight ones up to the drain
        timeout, then Goodbye."""
        self._drain.request()

    @property
    def draining(self) -> bool:
        return self._drain.requested

    def is_ready(self) -> bool:
        return not self.draining and not self.is_done

    def close(self) -> None:
        self.senders.close()
        self.router.close(linger=0)
        self.gateway.close()
        self.security.close()

    # ---- messages in ----
    def _receive(self, timeout_ms: int) -> None:
        if timeout_ms:
            poller = zmq.Poller()
            with self.gateway.locked() as gateway_sockets:
                for sock in (self.router, *gateway_sockets, *self.senders.sockets()):
                    poller.register(sock, zmq.POLLIN)
                poller.poll(timeout_ms)
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            key = self.security.peer_of(frames[-1])
            try:
                self._on_frames([f.bytes for f in frames], key)
            except Exception as exc:  # a bug met by one message: count it, fail its job, keep serving
                self._on_handler_error(frames[0].bytes, key, exc)
        for sender, record in self.gateway.poll_from():
            if isinstance(record, LoRAAdapterSet):
                self.lora_sync.apply(record)
                self._heartbeat.fire_now()  # the gateway waits for the version applied
            elif record.rid not in self.jobs or self.gateway.may_abort(sender, self.jobs[record.rid].job.gateway_id):
                self._abort(record.rid, f"gateway: {record.reason}")
            else:  # only the gateway that owns a job (or its decode worker) aborts it
                self.rejects.reject("not_assigned", sender, f"abort of another gateway's job {record.rid[:64]!r}")
        for gateway_id in self.gateway.lost():
            for state in [s for s in self.jobs.values() if s.job.gateway_id == gateway_id]:
                self._abort(state.rid, f"gateway {gateway_id} lost")

    def _on_handler_error(self, peer: bytes, key: str, exc: Exception) -> None:
        # The job it carried, if any, is either not recorded yet or fails later by its deadline.
        self.rejects.reject("handler_error", key or peer.hex(), repr(exc), exc_info=True)

    def _on_frames(self, frames: list[bytes], key: str = "") -> None:
        peer = frames[0]
        try:
            if len(frames) != 2:
                raise WireError(f"{len(frames) - 1} frames, expected 1")
            record = decode(frames[1], self.options.max_frame_bytes)
            if not isinstance(record, (PrefillJob, AbortRequest)):
                raise WireError(f"{type(record).__name__} is not a decode worker's message")
        except WireError as exc:
            self.metrics.malformed_frames.inc()
            self.rejects.reject("malformed", key or peer.hex(), str(exc))
            return
        sender = key or peer.hex()
        owner = self.jobs[record.rid].sender if record.rid in self.jobs else sender
        if owner != sender:  # only the decode worker that sent a job aborts or replaces it
            self.rejects.reject("not_assigned", sender, f"{type(record).__name__} for another peer's job")
        elif isinstance(record, AbortRequest):
            self._abort(record.rid, f"decode worker: {record.reason}")
        else:
            self._on_job(peer, record, sender)

    def _on_job(self, peer: bytes, job: PrefillJob, sender: str = "") -> None:
        self.metrics.jobs.inc()
        if job.rid in self.jobs:  # a retry under a new generation replaces the old attempt
            self._abort(job.rid, "superseded")
        reason = "draining" if self.draining else check_job(job, self.limits, time.time())
        if reason and reason != "draining":
            self.rejects.reject("invalid_value", peer.hex(), f"job {job.rid[:64]}: {reason}")
        if reason:
            label = "draining" if reason == "draining" else "bad_job"
            late = job.deadline <= time.time()  # nobody's fault: not the job's, which was fine while it lasted
            self._reply_failed(peer, job.rid, job.generation, reason, label, culprit="none" if late else "")
            return
        params = first_token_params(job.sampling)
        if reason := self.lora_error(params):  # not loaded here (yet): D retries or fails it
            self._reply_failed(peer, job.rid, job.generation, reason, label="bad_job", culprit="prefill")
            return
        seq = Sequence(
            next(self._seq_ids), list(job.token_ids), params, stop_token_ids=params.stop_ids(self._eos_token_ids)
        )
        bs = self.block_manager.block_size
        state = JobState(
            job,
            peer,
            seq,
            cdiv(len(job.token_ids), bs),
            time.monotonic(),
            next_block=job.skip_tokens // bs,
            sender=sender or peer.hex(),
        )
        if params.structured_output is not None:
            state.guide = self.new_guide_async(params)
        if self.tracer.enabled:
            state.trace = self.tracer.request(
                "prefill",
                job.traceparent,
                **{
                    "gen_ai.request.id": job.rid,
                    "pdserve.worker_id": self.options.worker_id,
                    "pdserve.prompt_tokens": len(job.token_ids),
                    "pdserve.skip_tokens": job.skip_tokens,
                },
            )
            state.trace.phase("queue")
        self.jobs[job.rid] = state
        self._queue.append(state)
        log.info(
            "rid=%s job: %d tokens, skip %d, %d dst blocks, generation %d",
            job.rid,
            len(job.token_ids),
            job.skip_tokens,
            len(job.dst_block_ids),
            job.generation,
        )

    # ---- admission ----
    def _admit(self) -> None:
        # Budget: every admitted job may take blocks for its whole prompt, pinned jobs hold theirs.
        # Staying under the pool size means the scheduler never has to preempt a prefill. A job
        # whose receiver is still handshaking waits without holding up jobs for other receivers.
        used = self.pins.num_pinned_blocks + sum(s.num_blocks_needed for s in self._by_seq.values())
        for state in list(self._queue):
            if not self._settle_guide(state):
                continue  # still compiling (holds no blocks: later jobs may go first), or failed
            try:
                if not self.senders.prepare(state.job.kv_address, state.job.kv_incarnation):
                    continue
            except HandshakeError as exc:
                self._fail(state, f"handshake with {state.job.kv_address} failed: {exc}", label="handshake")
                continue
            sender = self.senders.get(state.job.kv_address)
            if max(state.job.dst_block_ids) >= sender.peer_num_blocks:
                self.rejects.reject(
                    "invalid_value",
                    state.peer.hex(),
                    f"job {state.rid[:64]}: destination "
                    f"block {max(state.job.dst_block_ids)} outside the receiver's pool",
                )
                self._fail(
                    state,
                    f"destination block {max(state.job.dst_block_ids)} is outside the receiver's "
                    f"pool of {sender.peer_num_blocks} blocks",
                    label="bad_job",
                )
                continue
            if used + state.num_blocks_needed > self.block_manager.num_blocks:
                break  # first come, first served: no overtaking a job that waits for blocks
            self._queue.remove(state)
            try:
                self.scheduler.add(state.seq)
            except AdmissionError as exc:  # past a limit of this node's: the job was fine
                self._fail(state, str(exc), label="bad_job", culprit="prefill")
                continue
            state.in_scheduler = True
            self._by_seq[state.seq.seq_id] = state
            used += state.num_blocks_needed

    def _settle_guide(self, state: JobState) -> bool:
        """True once the job's structured output has its guide on the sequence (or it has none); a
        compile still running is False, and one that failed fails the job (False)."""
        if state.guide is None:
            return True
        if not state.guide.done():
            return False
        try:
            state.seq.guide = state.guide.result()
        except StructuredOutputError as exc:  # it compiled on the decode worker first
            self._fail(state, str(exc), label="bad_job", culprit="prefill")
            return False
        state.guide = None
        return True

    # ---- one step ----
    def _step(self, batch: ScheduledBatch) -> None:
        started_ns = time.time_ns() if self.tracer.enabled else 0
        sampled = self.runner.execute(batch)
        self.metrics.computed_tokens.inc(batch.num_batched_tokens)
        rows = {seq.seq_id: j for j, seq in enumerate(batch.sample_seqs)}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            state = self._by_seq[seq.seq_id]
            if state.trace:
                if state.phase == JobPhase.QUEUED:
                    state.trace.phase("prefill", at_ns=started_ns)
                state.trace.span(
                    "chunk",
                    started_ns,
                    start_token=seq.num_computed_tokens,
                    num_tokens=n,
                    batch_tokens=batch.num_batched_tokens,
                )
            state.phase = JobPhase.PREFILLING
            end = seq.num_computed_tokens + n  # postprocess advances the counter; the KV is there now
            if not self._push(state, end) or end < len(state.job.token_ids):
                continue
            j = rows[seq.seq_id]
            lp = sampled.logprobs[j] if sampled.logprobs is not None else None
            self._finish_compute(state, sampled.token_ids[j], lp)
        self.scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs)
        for seq in batch.seqs:
            if seq.is_finished:
                self._by_seq.pop(seq.seq_id, None)

    def _push(self, state: JobState, end: int) -> bool:
        """Queue the blocks this step finished that D lacks; False when the job failed instead."""
        job, seq = state.job, state.seq
        push = blocks_to_push(
            seq.block_table,
            job.dst_block_ids,
            job.skip_tokens,
            state.next_block,
            end,
            len(job.token_ids),
            self.block_manager.block_size,
        )
        state.next_block = push.next_block
        if not push.src_block_ids:
            return True
        sender = self.senders.get(job.kv_address)  # handshaken before admission
        if sender is None:
            self._fail(state, f"the KV receiver at {job.kv_address} restarted", label="transfer")
            return False
        pushed_ns = time.time_ns() if state.trace else 0
        sender.send(job.rid, job.generation, push.src_block_ids, push.dst_block_ids)
        state.is_sending = True
        if state.trace:
            state.trace.span("kv_push", pushed_ns, num_blocks=len(push.src_block_ids), transport=sender.transport)
        return True

    def _finish_compute(self, state: JobState, token: int, lp) -> None:
        job = state.job
        sender = self.senders.get(job.kv_address)
        if sender is None:
            self._fail(state, f"the KV receiver at {job.kv_address} restarted", label="transfer")
            return
        self.pins.pin(job.rid, state.seq)  # before postprocess releases the sequence's blocks
        state.phase = JobPhase.TRANSFERRING
        if state.trace:
            state.trace.phase("transfer")
        # the decode worker checks its request runs under the same adapter, files and all
        lora_name, lora_digest = job.sampling.lora_name, state.seq.params.lora_digest
        if not job.sample_first:
            sender.commit(job.rid, job.generation, lora_name=lora_name, lora_digest=lora_digest)
            return
        records = None if lp is None else [logprob_record(lp)]
        for frame in prompt_logprobs_frames(job.rid, state.seq.prompt_logprobs):
            self.gateway.send(job.gateway_id, frame)  # before the first token, on the same socket: it has them first
        self.gateway.send(job.gateway_id, TokenEvent(job.rid, 0, 0, [token], records))
        self.metrics.engine.time_to_first_token.observe(time.monotonic() - state.arrived_at)
        if records is None:
            sender.commit(job.rid, job.generation, token, lora_name=lora_name, lora_digest=lora_digest)
        else:
            sender.commit(
                job.rid,
                job.generation,
                token,
                lp.logprob,
                records[0].top_ids,
                records[0].top_logprobs,
                lora_name,
                lora_digest,
            )
        log.info("rid=%s computed; first token %d sent", job.rid, token)

    # ---- transfers ending ----
    def _on_transfer_events(self, events: list[TransferEvent]) -> None:
        for event in events:
            state = self.jobs.get(event.rid)
            if state is None or state.job.generation != event.generation:
                continue  # an attempt we aborted or replaced already
            state.is_sending = False
            if event.ok:
                self._drop(state)
                log.info("rid=%s committed on the decode worker", event.rid)
            elif event.released_by_receiver:  # D dropped the request (its abort may still be on the way)
                self._abort(event.rid, f"the decode worker released its blocks ({event.reason})")
            else:
                self._fail(state, f"transfer failed: {event.reason}", label="transfer")

    # ---- ending a job early ----
    def _abort(self, rid: str, reason: str) -> None:
        state = self.jobs.get(rid)
        if state is None:
            return  # idempotent: unknown or finished
        self.metrics.jobs_aborted.inc()
        log.info("rid=%s aborted (%s) while %s", rid, reason, state.phase.name.lower())
        self._drop(state, abort_reason=reason)

    def _fail(self, state: JobState, reason: str, label: str, culprit: str = "") -> None:
        log.warning("rid=%s failed: %s", state.rid, reason)
        self._drop(state, abort_reason=reason)
        self._reply_failed(state.peer, state.rid, state.job.generation, reason, label, culprit)

    def _drop(self, state: JobState, abort_reason: str = "") -> None:
        """Forget a job and free everything it holds here (idempotent per state)."""
        job = state.job
        if state.trace:
            state.trace.end(abort_reason or None)
        if self.jobs.get(job.rid) is state:
            del self.jobs[job.rid]
        if state in self._queue:
            self._queue.remove(state)
        if state.guide is not None:
            state.guide.cancel()  # a compile not started never runs; one under way ends on its thread, unread
            state.guide = None
        if state.in_scheduler and not state.seq.is_finished:
            self.scheduler.abort(state.seq.seq_id)
        self._by_seq.pop(state.seq.seq_id, None)
        if abort_reason and state.is_sending:
            self.senders.abort(job.kv_address, job.rid, job.generation, abort_reason)
            state.is_sending = False
        self.pins.unpin(job.rid)

    def _reply_failed(self, peer: bytes, rid: str, generation: int, reason: str, label: str, culprit: str = "") -> None:
        """``culprit`` (protocol/serving.py PrefillFailed): "" takes the label's (CULPRIT_OF_LABEL)."""
        self.metrics.jobs_rejected.labels(label).inc()
        failed = PrefillFailed(rid, generation, reason[:500], culprit or CULPRIT_OF_LABEL[label])
        try:
            self.router.send_multipart([peer, encode(failed)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the decode worker is gone: nobody to tell
            log.info("rid=%s could not report the failure: decode worker unreachable", rid)

    def _expire(self) -> None:
        now = time.time()
        for state in [s for s in self.jobs.values() if s.job.deadline <= now]:
            self._fail(state, "deadline passed", label="deadline")

    # ---- around the work ----
    def _after_turn(self) -> None:
        num_transferring = sum(1 for s in self.jobs.values() if s.phase == JobPhase.TRANSFERRING)
        self.metrics.update(self.scheduler, len(self._queue), num_transferring, self.queued_prefill_tokens())
        self.metrics.engine.check_integrity_if_idle(self.block_manager, not self.jobs, time.monotonic())
        if self._drain.start_if_requested():
            log.info("draining: %d jobs in flight, %.1f s to finish", len(self.jobs), self._drain.timeout_s)
            self._heartbeat.fire_now()  # tell the gateway now, not at the next interval
        if self._heartbeat.due():
            self.liveness.send(self.heartbeat())
        if self._drain.is_over(in_flight=bool(self.jobs)):
            for state in list(self.jobs.values()):
                self._fail(state, "worker shut down before the job finished", label="draining")
            self.liveness.goodbye(self.options.worker_id)
            self.is_done = True
            log.info("drained; goodbye")

    def heartbeat(self) -> Heartbeat:
        bm = self.block_manager
        num_transferring = sum(1 for s in self.jobs.values() if s.phase == JobPhase.TRANSFERRING)
        return Heartbeat(
            worker_id=self.options.worker_id,
            role="prefill",
            address=self.address,
            incarnation=self.incarnation,
            proof=self.gateway.registration_proof(self.incarnation, "prefill"),
            block_size=bm.block_size,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_allocatable_blocks,
            kv_blocks_in_use=bm.num_in_use_blocks,
            num_running=self.scheduler.num_running + num_transferring,
            num_waiting=self.scheduler.num_waiting + len(self._queue),
            queued_prefill_tokens=self.queued_prefill_tokens(),
            draining=self.draining,
            **self.lora_sync.heartbeat_fields(),
        )

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed across queued and running jobs."""
        return sum(s.num_uncomputed_tokens for s in self.jobs.values())

    def phase_of(self, rid: str) -> JobPhase | None:
        state = self.jobs.get(rid)
        return state.phase if state is not None else None
