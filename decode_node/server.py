"""The decode worker: reservation, continuous batching, streaming, local prefill fallback.

Life cycle of a request on this node:
1. ``Generate`` arrives from the gateway over the worker DEALER. A bad request (token ids outside the
   vocabulary, sampling out of range, prompt longer than the context) gets a TokenEvent(error) at once;
   while draining, or when the pool cannot hold it now, the answer is ``Busy`` at once. A structured
   output's grammar first compiles on the grammar thread (``COMPILING``: nothing held, the other
   requests keep decoding); one that does not compile is refused as a bad request is.
2. The prompt is matched against this node's prefix cache. The KV this node still needs:

       n == 1:  token_ids [ cached here (skip) | from the prefill worker ........ ]   P samples token 0
       n >  1:  token_ids [ cached here (skip) | from the prefill worker ... | last ]  D computes the last
                0                               skip                               len(prompt)
3. Remote prefill (``prefill_address`` set and something is missing): blocks for the missing range are
   reserved (with one spare block of room to decode, else Busy), the range is reserved in the KV
   receiver (lease, a new transfer generation per attempt) and a ``PrefillJob`` goes to that prefill
   worker. Local prefill (``prefill_address`` "" or nothing missing): the request joins the engine
   scheduler's waiting queue and is prefilled here in chunks.
4. The KV receiver reports the transfer: committed -> the blocks are adopted, the tokens count as
   computed (and enter the prefix cache), the first token from the Commit is appended (n == 1) and the
   sequence joins the running batch. Failed (expired lease, sender abort, incomplete commit) or a
   ``PrefillFailed`` -> everything is freed and the request ends with TokenEvent(error); the gateway
   may retry it elsewhere.
5. Every engine step (decode tokens and local prefill chunks in one batch; n > 1 forks copy-on-write;
   preemption recomputes here) streams each completion's new tokens as a TokenEvent ordered by offset,
   with logprobs when asked, and a finish reason on its last one. A prompt prefilled here sends its
   prompt logprobs, when asked, just before its first event (``PromptLogprobs``); n > 1 with prompt
   logprobs is always prefilled here, since the prefill worker would not compute the last token.
6. On finish the full blocks stay in the prefix cache and the rest are freed. ``AbortRequest`` or the
   deadline, at any phase, frees everything (and forwards the abort to the prefill worker while its
   job is out).
Alongside: a Heartbeat (load from the block manager, and how far the loop has got) to every gateway
every interval, repeated by a thread of its own while a step runs long (worker/liveness.py); a gateway that
stops acking them (worker/gateway_links.py) takes its requests with it: they are released as an abort
would. SIGTERM drains: Busy to new work, in-flight requests get ``drain_timeout_s``, then ``Goodbye``
and the loop returns.

This file is that life cycle, one group of methods per step above, read top to bottom (hence its
length); what is not the life cycle lives beside it: admission checks (admission.py), a Commit's checks
(commit_check.py), load reports (load_report.py), prefill worker links (prefill_links.py), request
state (request_state.py), a step's threads (step_threads.py), token events (streaming.py).

One thread runs everything but grammar compiles and the heartbeat repeats: it polls the sockets (briefly
when idle) and runs an engine step when there is work. Nothing in a step waits on the network.

Peers are not trusted (docs/security.md): a request's KV is taken only from the prefill worker's key the
gateway named (``Generate.prefill_key``), a first token outside the vocabulary fails its request, and a
message whose handling raises is counted (``handler_error``), its request failed and freed, and the
loop goes on. A lost gateway connection aborts every request that gateway sent (their streams have no
reader any more) and frees their blocks.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from decode_node.admission import RequestError, make_sequence
from decode_node.commit_check import PREFILL, commit_problem
from decode_node.load_report import decode_heartbeat, engine_snapshot, queued_prefill_tokens
from decode_node.prefill_links import PrefillLinks
from decode_node.request_state import DecodeRequest, Phase
from decode_node.speculation import acceptance_note
from decode_node.step_threads import StepThreads
from decode_node.streaming import error_event, event_frames, new_tokens_event
from engine.kv.block_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.lora.sync import LoRASync
from engine.sampling.sampler import TokenLogprobs, continue_seeded_stream
from engine.sampling.structured_output import StructuredOutputError
from engine.sched.scheduler import AdmissionError
from engine.sched.sequence import SequenceStatus
from kvtransfer.events import TransferEvent
from kvtransfer.receiver import KVReceiver
from protocol.rejects import RejectLog
from protocol.serving import (
    AbortRequest,
    Busy,
    Generate,
    Heartbeat,
    LoRAAdapterSet,
    PrefillFailed,
    PrefillJob,
    TokenEvent,
)
from telemetry.tracing import NO_TRACING, RequestTrace, Tracer
from worker import Drain, EngineMetrics, EngineSnapshot, GatewayLinks, HeartbeatTimer
from worker.liveness import Liveness, StepWatch
from worker.logprob_records import prompt_logprobs_frames
from worker.step_pacer import StepPacer

log = logging.getLogger(__name__)

IDLE_POLL_MS = 10  # nothing to do: wait this long for a message (a KV message wakes the wait too)
BUSY_POLL_MS = 1  # a grammar compiles (a future, not a socket), or KV comes in-process: look this often


@dataclass(slots=True)
class DecodeOptions:
    worker_id: str
    kv_address: str  # this node's KV receiver endpoint, sent in PrefillJobs and heartbeats
    incarnation: str  # new on every process start
    heartbeat_s: float = 5.0
    step_timeout_s: float = 0.0  # gateway.worker_step_timeout_s: a step past it is logged with the stacks
    drain_timeout_s: float = 30.0
    idle_prefill_threads: int = 0  # a step's extra threads while no prompt is out (step_threads.py)


class DecodeServer:
    def __init__(
        self,
        engine: LLMEngine,
        gateway: GatewayLinks,
        receiver: KVReceiver,
        prefill: PrefillLinks,
        metrics: EngineMetrics,
        options: DecodeOptions,
        rejects: RejectLog | None = None,
        tracer: Tracer = NO_TRACING,
    ):
        self.rejects = rejects or receiver.rejects
        self.engine = engine
        self.scheduler = engine.scheduler
        self.block_manager = engine.block_manager
        self.gateway = gateway
        self.receiver = receiver
        self.prefill = prefill
        self.metrics = metrics
        self.options = options
        self.tracer = tracer
        self.requests: dict[str, DecodeRequest] = {}
        self._compiling: dict[str, tuple[Generate, Future]] = {}  # COMPILING requests: what they asked, their guide
        self._by_seq_id: dict[int, DecodeRequest] = {}
        self._seq_ids = itertools.count()
        self._generations = itertools.count(1)
        self._heartbeat = HeartbeatTimer(options.heartbeat_s)
        self.liveness = Liveness(gateway, options.heartbeat_s, StepWatch(), stuck_after_s=options.step_timeout_s)
        self.lora_sync = LoRASync(engine.runner.lora)
        self._drain = Drain(options.drain_timeout_s)
        self._threads = StepThreads(options.idle_prefill_threads)
        sched = self.scheduler.config
        self._pacer = StepPacer(sched.max_num_batched_tokens, options.heartbeat_s, sched.prefill_chunk_size)
        self._stopped = False
        self.is_running = False  # the loop has started and not ended (readiness)

    # ---- the loop ----
    def is_ready(self) -> bool:
        return self.is_running and not self._drain.requested

    def request_drain(self) -> None:
        """Signal-safe: only sets a flag the loop reads."""
        self._drain.request()

    def stop(self) -> None:
        """Leave the loop at the next iteration without draining (tests, fatal errors)."""
        self._stopped = True

    def run(self) -> None:
        self.is_running = True
        try:
            self.liveness.start(self._heartbeat_record())
            while not self._stopped:
                with self.liveness.watch.step():
                    self.run_once()
        finally:
            self.liveness.stop()
            self.is_running = False

    def run_once(self) -> None:
        self._wait_for_messages()
        for sender, record in self.gateway.poll_from():
            if isinstance(record, AbortRequest) and not self._may_abort(sender, record.rid):
                continue  # another gateway's request: only the gateway that owns it aborts it
            self._guarded(self._on_gateway_record, record, "gateway")
        for gateway_id in self.gateway.lost():
            self._on_gateway_lost(gateway_id)
        for address, failed in self.prefill.poll():
            self._guarded(self._on_prefill_failed, failed, address)
        for event in self.receiver.poll():
            self._guarded(self._on_transfer, event, "kv receiver")
        self._on_compiled()
        self._expire_deadlines()
        if self.scheduler.has_unfinished():
            try:
                self._step()
            except Exception:
                self._on_step_error()
        self._update_metrics()
        if self._heartbeat.due():
            self.liveness.send(self._heartbeat_record())
        self._drain_tick()

    def _wait_for_messages(self) -> None:
        if self.scheduler.has_unfinished():
            return  # work to do: look at sockets without waiting
        kv_socket = self.receiver.channel.socket
        if self._compiling or (kv_socket is None and self._awaiting_kv()):
            timeout = BUSY_POLL_MS
        else:
            timeout = min(IDLE_POLL_MS, int(self._heartbeat.seconds_left() * 1000) + 1)
        poller = zmq.Poller()
        with self.gateway.locked() as gateway_sockets:
            for sock in [*gateway_sockets, *self.prefill.sockets(), *([kv_socket] if kv_socket is not None else [])]:
                poller.register(sock, zmq.POLLIN)
            poller.poll(timeout)

    def _awaiting_kv(self) -> bool:
        return any(r.phase == Phase.AWAITING_KV for r in self.requests.values())

    def _guarded(self, handle, record, peer: str) -> None:
        """Handle one message; if that raises, count it, fail and free its request, and go on."""
        try:
            handle(record)
        except Exception as exc:
            self.rejects.reject("handler_error", peer, f"{type(record).__name__}: {exc!r}", exc_info=True)
            req = self.requests.get(record.rid)
            if req is not None:
                try:
                    self._fail(req, "internal error on the decode worker", culprit="decode")
                except Exception:
                    log.exception("rid=%s could not be released after an internal error", record.rid)

    def _on_step_error(self) -> None:
        """An engine step raised (a bug, a device error): whatever it ran may be half-updated, so every
        request in the engine fails, blaming this worker, and frees its blocks; the loop goes on, and
        requests still awaiting KV or compiling are untouched."""
        log.exception("engine step failed: failing the %d requests in the engine", self.scheduler.num_running)
        self.metrics.step_errors.inc()
        for req in [r for r in self.requests.values() if r.phase == Phase.SCHEDULED]:
            try:
                self._fail(req, "internal error on the decode worker: an engine step failed", culprit="decode")
            except Exception:
                log.exception("rid=%s could not be released after a failed step", req.rid)

    def _on_gateway_record(self, record) -> None:
        if isinstance(record, Generate):
            self._on_generate(record)
        elif isinstance(record, LoRAAdapterSet):
            self.lora_sync.apply(record)
            self._heartbeat.fire_now()  # the gateway waits for the version applied
        else:
            self._on_abort(record)

    # ---- 1-3. arrival ----
    def _on_generate(self, gen: Generate) -> None:
        if gen.rid in self.requests:
            self._send_error_all(
                gen.rid, gen.gateway_id, gen.sampling.n, "request id already in use on this worker", culprit="none"
            )
            return
        if self._drain.requested:
            self._busy(gen.rid, gen.gateway_id, "worker is draining")
            return
        try:
            seq = make_sequence(next(self._seq_ids), gen, self.engine)
            self.scheduler.check_admissible(seq)
        except (RequestError, AdmissionError) as exc:
            self.metrics.request_failure.labels("invalid").inc()
            self._send_error_all(gen.rid, gen.gateway_id, gen.sampling.n, str(exc), refused=True)
            return
        req = DecodeRequest(gen.rid, seq, gen.deadline, time.monotonic(), Phase.SCHEDULED, gateway_id=gen.gateway_id)
        if gen.deadline <= time.time():
            self._send_error_all(
                gen.rid, gen.gateway_id, seq.params.n, "deadline passed before the request arrived", culprit="none"
            )
            return
        if self.tracer.enabled:
            req.trace = self.tracer.request(
                "decode",
                gen.traceparent,
                **{
                    "gen_ai.request.id": gen.rid,
                    "pdserve.worker_id": self.options.worker_id,
                    "gen_ai.usage.prompt_tokens": seq.num_prompt_tokens,
                },
            )
        if seq.params.structured_output is not None:
            if req.trace:
                req.trace.phase("compile_grammar")
            req.phase = Phase.COMPILING
            self._compiling[gen.rid] = (gen, self.engine.new_guide_async(seq.params))
            self._track(req)
            return
        self._start(req, gen)

    def _on_compiled(self) -> None:
        """Requests whose grammar compiled go on where _on_generate left them; a grammar that does not
        compile refuses its request (a 400 at the gateway), as if it had been refused on arrival."""
        for rid, (gen, future) in [(rid, entry) for rid, entry in self._compiling.items() if entry[1].done()]:
            del self._compiling[rid]
            req = self.requests[rid]
            self._forget(req)
            try:
                req.seq.guide = future.result()
            except StructuredOutputError as exc:
                self.metrics.request_failure.labels("invalid").inc()
                self._send_error_all(rid, req.gateway_id, req.seq.params.n, str(exc), refused=True)
                if req.trace:
                    req.trace.end(str(exc))
                continue
            req.phase = Phase.SCHEDULED
            self._start(req, gen)

    def _start(self, req: DecodeRequest, gen: Generate) -> None:
        if req.trace:
            req.trace.phase("reserve")
        seq = req.seq
        remote_tokens = self._kv_needed_from_prefill(seq)
        _, hit_tokens = self.block_manager.prefix_hit(seq)
        if gen.prefill_address and remote_tokens > hit_tokens and not gen.sampling.prefills_on_decode:
            self._start_remote_prefill(req, gen, remote_tokens)
        else:
            self._start_local_prefill(req)

    @staticmethod
    def _kv_needed_from_prefill(seq) -> int:
        # n > 1: the last prompt token is computed here, so its logits can seed every completion.
        return seq.num_prompt_tokens if seq.params.n == 1 else seq.num_prompt_tokens - 1

    def _start_local_prefill(self, req: DecodeRequest) -> None:
        seq, bm = req.seq, self.block_manager
        # Room now for the whole prompt plus a block to decode into, beyond what queued requests need.
        queued = sum(cdiv(s.num_tokens, bm.block_size) for s in self.scheduler.waiting)
        _, hit_tokens = bm.prefix_hit(seq)
        needed = cdiv(seq.num_tokens - hit_tokens, bm.block_size) + 1
        if needed + queued > bm.num_allocatable_blocks:
            self._busy(
                req.rid,
                req.gateway_id,
                f"KV pool full: needs {needed} blocks, {bm.num_allocatable_blocks - queued} available",
                req.trace,
            )
            return
        self.scheduler.add(seq)
        self._track(req)
        if req.trace:
            req.trace.phase("prefill_local", cached_tokens=hit_tokens)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        log.info(
            "rid=%s local prefill: %d prompt tokens, %d cached, n=%d",
            req.rid,
            seq.num_prompt_tokens,
            hit_tokens,
            seq.params.n,
        )

    def _start_remote_prefill(self, req: DecodeRequest, gen: Generate, num_tokens: int) -> None:
        seq, bm = req.seq, self.block_manager
        if self.receiver.needs_sender_key and not gen.prefill_key:
            # "" would let any member write this request's KV: a gateway always names the prefill worker.
            error = "refused: the request names no prefill worker key (Generate.prefill_key)"
            if req.trace:
                req.trace.end(error)
            self.metrics.request_failure.labels("invalid").inc()
            self._send_error_all(req.rid, req.gateway_id, seq.params.n, error)
            return
        if not bm.can_reserve(seq, num_tokens, num_spare_blocks=1):
            self._busy(
                req.rid, req.gateway_id, f"KV pool full: {bm.num_allocatable_blocks} blocks available", req.trace
            )
            return
        dst_block_ids = bm.reserve(seq, num_tokens)
        skip = seq.num_computed_tokens  # the prefix hit, whole blocks
        req.phase, req.prefill_address, req.generation = Phase.AWAITING_KV, gen.prefill_address, next(self._generations)
        self.receiver.reserve(req.rid, req.generation, dst_block_ids, sender_key=gen.prefill_key)
        job = PrefillJob(
            rid=req.rid,
            token_ids=seq.token_ids[:num_tokens],
            skip_tokens=skip,
            dst_block_ids=dst_block_ids,
            generation=req.generation,
            kv_address=self.options.kv_address,
            sample_first=seq.params.n == 1,
            sampling=gen.sampling,
            deadline=gen.deadline,
            kv_incarnation=self.receiver.incarnation,
            traceparent=req.trace.traceparent() if req.trace else "",
            gateway_id=gen.gateway_id,
        )
        self._track(req)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        if not self.prefill.send(gen.prefill_address, job):
            self._fail(req, f"prefill worker {gen.prefill_address} is not accepting jobs", culprit="prefill")
            return
        log.info(
            "rid=%s prefill job -> %s: tokens [%d, %d), %d blocks, generation %d",
            req.rid,
            gen.prefill_address,
            skip,
            num_tokens,
            len(dst_block_ids),
            req.generation,
        )
        if req.trace:
            req.trace.phase(
                "wait_kv", prefill_address=gen.prefill_address, cached_tokens=skip, num_blocks=len(dst_block_ids)
            )

    def _track(self, req: DecodeRequest) -> None:
        self.requests[req.rid] = req
        self._by_seq_id[req.seq.seq_id] = req

    # ---- 4. the transfer ends ----
    def _on_transfer(self, event: TransferEvent) -> None:
        req = self.requests.get(event.rid)
        if req is None or req.phase != Phase.AWAITING_KV or req.generation != event.generation:
            return  # aborted or retried meanwhile: the receiver already freed that range
        if not event.ok:
            # Its lease ran out (the KV never came), it aborted, restarted or committed half: the sender's doing.
            self._fail(req, f"KV transfer from prefill worker failed: {event.reason}", PREFILL, abort_receiver=False)
            return
        commit, seq = event.commit, req.seq
        self.receiver.adopt(req.rid)  # the range is ours again (the seq has held its blocks all along)
        req.prefill_address = ""
        vocab_size = self.engine.model_config.vocab_size
        problem = commit_problem(commit, seq, vocab_size)
        if problem is not None:
            if problem.bad_token is not None:
                self.rejects.reject(
                    "invalid_value",
                    "prefill worker",
                    f"rid={req.rid} token {problem.bad_token} outside the vocabulary of {vocab_size}",
                )
            self._fail(req, problem.error, problem.culprit, abort_receiver=False)
            return
        req.phase = Phase.SCHEDULED
        num_computed = self._kv_needed_from_prefill(seq)
        if seq.params.n == 1:
            seq.token_ids.append(commit.first_token)
            continue_seeded_stream(seq, self.engine.model_config.vocab_size, self.engine.runner.device)
            if seq.params.logprobs is not None:
                logprob = commit.first_logprob if commit.first_logprob is not None else math.nan
                seq.output_logprobs.append(
                    TokenLogprobs(commit.first_token, logprob, list(zip(commit.top_token_ids, commit.top_logprobs)))
                )
            req.num_sent[0] = 1  # the prefill worker streamed token 0 to the gateway itself
            req.last_token_at = time.monotonic()
        self.block_manager.mark_computed(seq, num_computed)
        finished_at_once = self.scheduler.add_prefilled(seq)
        log.info("rid=%s KV committed: %d tokens, running", req.rid, num_computed)
        if req.trace:
            req.trace.phase("decode")
        if finished_at_once:
            self._emit(req, 0, seq)

    def _on_prefill_failed(self, failed: PrefillFailed) -> None:
        req = self.requests.get(failed.rid)
        if req is None or req.phase != Phase.AWAITING_KV or req.generation != failed.generation:
            return
        req.prefill_address = ""  # it gave the job up: nothing to abort there
        self._fail(req, f"prefill failed: {failed.reason}", failed.culprit)

    # ---- 5. one engine step ----
    def _step(self) -> None:
        self.scheduler.config.max_num_batched_tokens = self._pacer.budget()  # a step within a heartbeat
        batch = self.scheduler.schedule()
        if batch is None:
            return
        self._threads.set_for_step(prompts_out=self._awaiting_kv)
        started = time.monotonic()
        sampled = self.engine.runner.execute(batch)
        self._pacer.record(batch.num_batched_tokens, time.monotonic() - started)
        self.engine.num_computed_tokens += batch.num_batched_tokens
        self.scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs, sampled.accepted)
        seen = set()
        outbox: dict[str, list[TokenEvent]] = {}  # the step's events, by gateway: one frame each
        for seq in batch.sample_seqs:
            if seq.seq_id in seen:
                continue
            seen.add(seq.seq_id)
            req = self._by_seq_id.get(self.scheduler.request_id_of(seq))
            if req is not None and req.rid in self.requests:
                self._emit(req, self.scheduler.completion_index_of(seq), seq, outbox)
        for gateway_id, events in outbox.items():
            for frame in event_frames(events):
                self.gateway.send(gateway_id, frame)

    def _emit(self, req: DecodeRequest, index: int, seq, outbox: dict[str, list[TokenEvent]] | None = None) -> None:
        """Sends ``seq``'s new tokens to its gateway, or puts them in ``outbox`` for the caller to send
        with the rest of the step's (after any prompt logprobs frames, which go at once)."""
        if req.done[index] or seq.status == SequenceStatus.FINISHED_ABORTED:
            return
        num_cached = -1 if req.announced[index] else req.seq.num_cached_tokens  # on D's first event only
        event = new_tokens_event(req.rid, index, seq, req.num_sent[index], req.wants_logprobs, num_cached)
        if event is None:
            return
        if index == 0 and not req.announced[0] and req.num_sent[0] == 0 and seq.params.prompt_logprobs is not None:
            for frame in prompt_logprobs_frames(req.rid, seq.prompt_logprobs):  # prefilled here: ours to send
                self.gateway.send(req.gateway_id, frame)
        req.announced[index] = True
        now = time.monotonic()
        if event.token_ids:
            if req.num_sent[index] == 0:
                self.metrics.time_to_first_token.observe(now - req.arrived)
                if req.trace and index == 0:  # prefilled here: its first token ends the prefill
                    req.trace.phase("decode")
            elif req.last_token_at:
                self.metrics.inter_token_latency.observe(now - req.last_token_at)
            req.last_token_at = now
        self.metrics.generation_tokens.inc(len(event.token_ids))
        req.num_sent[index] += len(event.token_ids)
        if outbox is None:
            self.gateway.send(req.gateway_id, event)
        else:
            outbox.setdefault(req.gateway_id, []).append(event)
        if event.finish_reason:
            req.done[index] = True
            if req.is_done:
                self._forget(req)
                self.metrics.request_success.labels(event.finish_reason).inc()
                self.metrics.e2e_request_latency.observe(now - req.arrived)
                log.info("rid=%s finished: %s%s", req.rid, event.finish_reason, acceptance_note(seq))
                if req.trace:
                    req.trace.end(
                        None,
                        **{
                            "gen_ai.response.finish_reasons": event.finish_reason,
                            "gen_ai.usage.completion_tokens": sum(req.num_sent),
                        },
                    )

    # ---- 6. abort, deadline, failure ----
    def _on_abort(self, abort: AbortRequest) -> None:
        req = self.requests.get(abort.rid)
        if req is not None:
            log.info("rid=%s aborted by the gateway: %s", req.rid, abort.reason or "no reason given")
            if req.trace:
                req.trace.end(None, **{"pdserve.aborted": abort.reason or "by the gateway"})
            self._release(req)
            self.metrics.request_failure.labels("aborted").inc()

    def _may_abort(self, sender: str, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or self.gateway.may_abort(sender, req.gateway_id):
            return True
        self.rejects.reject("not_assigned", sender, f"abort of another gateway's request {rid[:64]!r}")
        return False

    def _on_gateway_lost(self, gateway_id: str) -> None:
        """Nobody reads these requests' tokens any more: free what they hold, as an abort would."""
        orphans = [req for req in self.requests.values() if req.gateway_id == gateway_id]
        log.warning("gateway %s lost: aborting its %d requests", gateway_id, len(orphans))
        for req in orphans:
            self._release(req)
            self.metrics.request_failure.labels("aborted").inc()

    def _expire_deadlines(self) -> None:
        now = time.time()
        for req in [r for r in self.requests.values() if r.deadline <= now]:
            self._fail(req, "deadline exceeded", culprit="none")

    def _fail(self, req: DecodeRequest, error: str, culprit: str, *, abort_receiver: bool = True) -> None:
        """End ``req`` with an error event blaming ``culprit`` (protocol/serving.py CULPRITS) and free it."""
        log.warning("rid=%s failed (%s's fault): %s", req.rid, culprit, error)
        if req.trace:
            req.trace.end(error)
        self._release(req, abort_receiver=abort_receiver)
        self.metrics.request_failure.labels("error").inc()
        for index, done in enumerate(req.done):
            if not done:
                self.gateway.send(
                    req.gateway_id, error_event(req.rid, index, req.num_sent[index], error, culprit=culprit)
                )

    def _release(self, req: DecodeRequest, *, abort_receiver: bool = True) -> None:
        """Free everything the request holds, whatever its phase."""
        if req.phase == Phase.COMPILING:
            _, compiling = self._compiling.pop(req.rid, (None, None))
            if compiling is not None:
                compiling.cancel()  # one not started never runs; one under way ends on its thread, unread
        elif req.phase == Phase.AWAITING_KV:
            if abort_receiver:
                self.receiver.abort(req.rid)  # idempotent; the fence comes down before the blocks are reused
            if req.prefill_address:
                self.prefill.send(req.prefill_address, AbortRequest(req.rid, "aborted on the decode worker"))
            self.block_manager.deallocate(req.seq)
        else:
            self.scheduler.abort(req.seq.seq_id)
        self._forget(req)

    def _forget(self, req: DecodeRequest) -> None:
        self.requests.pop(req.rid, None)
        self._by_seq_id.pop(req.seq.seq_id, None)

    def _busy(self, rid: str, gateway_id: str, reason: str, trace: RequestTrace | None = None) -> None:
        if trace:
            trace.end(f"busy: {reason}")
        self.metrics.request_failure.labels("busy").inc()
        log.info("rid=%s busy: %s", rid, reason)
        self.gateway.send(gateway_id, Busy(rid, reason))

    def _send_error_all(
        self, rid: str, gateway_id: str, n: int, error: str, refused: bool = False, culprit: str = "none"
    ) -> None:
        log.warning("rid=%s refused: %s", rid, error)
        for index in range(n):
            self.gateway.send(gateway_id, error_event(rid, index, 0, error, refused, culprit))

    # ---- load, metrics, drain ----
    def snapshot(self) -> EngineSnapshot:
        return engine_snapshot(self.scheduler, self.block_manager, self.requests.values())

    def _update_metrics(self) -> None:
        self.metrics.update(self.snapshot())
        is_idle = not self.requests and not self.scheduler.has_unfinished()
        self.metrics.check_integrity_if_idle(self.block_manager, is_idle, time.monotonic())

    def _heartbeat_record(self) -> Heartbeat:
        return decode_heartbeat(
            self.snapshot(),
            queued_prefill_tokens(self.scheduler),
            self._drain.requested,
            worker_id=self.options.worker_id,
            address=self.options.kv_address,
            incarnation=self.options.incarnation,
            proof=self.gateway.registration_proof(self.options.incarnation, "decode"),
            **self.lora_sync.heartbeat_fields(),
        )

    def _drain_tick(self) -> None:
        if self._drain.start_if_requested():
            log.info("draining: %d requests in flight, %.1f s to finish", len(self.requests), self._drain.timeout_s)
            self.liveness.send(self._heartbeat_record())  # tell the gateways now, not at the next interval
        if not self._drain.is_over(in_flight=bool(self.requests)):
            return
        for req in list(self.requests.values()):
            self._fail(req, "decode worker shut down before the request finished", culprit="none")
        self.liveness.send(self._heartbeat_record())  # the final load: nothing held any more
        self.liveness.goodbye(self.options.worker_id)
        log.info("drained; goodbye")
        self._stopped = True
