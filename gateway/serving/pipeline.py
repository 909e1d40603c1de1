"""The one way of every API dialect (completions, chat, Responses, Messages: each a ``Dialect`` record,
gateway/serving/dialect.py): parse -> tokenize -> admit -> generate -> JSON or SSE.

1. parse and validate the body in its dialect (400 naming the field); unknown model -> 404
2. admission: too many requests in flight, or the backend says it has no capacity -> 503 + Retry-After
3. tokenize (chat: render the template first); prompt + max_tokens checked against the context (400)
4. one backend request per prompt, carrying n (its completions come back told apart by index); the first
   event of each is awaited before answering, so "no capacity" is still a proper 503. A stream whose
   first events take longer than the SSE keep-alive interval (queued, a long prefill) starts anyway:
   ``: keep-alive`` comments hold the connection, and a failure after that is told in-band
5. non-stream: collect, answer JSON; stream: SSE chunks, usage chunk if asked, then [DONE] (the
   Responses API: its named events, response.completed last), each built by the dialect's
   ``OutputBuilder``. A background response: answered ``queued`` before step 4, which goes on without
   the client (gateway/dialects/responses/background.py)
6. client disconnect at any point -> abort every unfinished backend request

One class, ``Serving``, holds those steps in that order (its length is the one pipeline read top to
bottom); what a step needs beyond it lives in its own module: the dialect records (dialect.py), a
request's completions merged and ordered (choice.py), generation (generation.py), the request report
(request_report.py), LoRA adapter routes (lora_adapters.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.dialects.anthropic.request import parse_messages
from gateway.dialects.openai.chat_prompt import ChatPrompt
from gateway.dialects.openai.output import LogprobFormatter, ResponseOptions, usage
from gateway.dialects.openai.request import ParsedRequest, resolve_max_tokens, truncate_prompt
from gateway.dialects.responses.background import BackgroundResponses
from gateway.dialects.responses.conversation_fit import fit_conversation
from gateway.dialects.responses.store import ResponseStore
from gateway.dialects.responses.tenants import TenantStore, tenant_of
from gateway.http.errors import APIError, bad_request, no_capacity
from gateway.http.request_id import HEADER as REQUEST_ID_HEADER
from gateway.http.sse import EventStreamResponse, wait_for_disconnect
from gateway.metrics import GatewayMetrics
from gateway.serving.key_salt import api_key_of, salt_for_key
from gateway.text.chat_output import ChatParsers, ChatShape
from gateway.text.reasoning import PARSERS as REASONING_PARSERS
from gateway.text.tokenizer import ChatTemplateError, Tokenizer
from gateway.workers.backend import Backend, GenerationRequest
from telemetry.tracing import KIND_SERVER, NO_TRACING, RequestTrace, Tracer

from .choice import ChoiceState
from .dialect import Asked, Dialect, OutputBuilder, OutputContext, ParseContext, StoredOutput
from .generation import Generation
from .lora_adapters import LoRAAdapters
from .request_report import RequestReport

log = logging.getLogger("pdserve.gateway")


@dataclass(slots=True)
class ServingLimits:
    model_name: str
    max_model_len: int
    max_concurrent_requests: int = 256
    retry_after_s: int = 1
    request_timeout_s: float | None = None  # becomes each backend request's deadline
    max_prompt_logprobs_entries: int = 262144  # gateway.max_prompt_logprobs_entries
    sse_keepalive_s: float | None = 15.0  # gateway.sse_keepalive_s; None: no keep-alive comments
    cache_salt_per_api_key: bool = False  # gateway.cache_salt_per_api_key: tenants share no prefix KV


class Serving:
    """The pipeline behind every generation route; ``serve`` answers one request in its dialect."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: Backend,
        limits: ServingLimits,
        metrics: GatewayMetrics,
        parsers: ChatParsers = ChatParsers(),
        store: ResponseStore | None = None,
        tracer: Tracer = NO_TRACING,
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self._tok = tokenizer
        # the LoRA adapters a request may name as its model (also /v1/models and the load routes')
        self.adapters = adapters if adapters is not None else LoRAAdapters(limits.model_name, enabled=False)
        self.store = (
            store if store is not None else ResponseStore(0)
        )  # the Responses API's; also read by the routes that show it
        self.background = BackgroundResponses()  # its background responses still running
        self._parsers = parsers
        self._backend = backend
        self._limits = limits
        self._metrics = metrics
        self._tracer = tracer
        self._formats = {as_ids: LogprobFormatter(tokenizer, as_ids) for as_ids in (False, True)}
        self.num_in_flight = 0

    async def serve(self, request: Request, body, dialect: Dialect) -> object:
        """The answer to ``body`` in ``dialect``: the completion or chat request it amounts to, generated,
        and answered by the dialect's output builder."""
        trace = self._trace(request)
        try:
            store = TenantStore(self.store, tenant_of(request.headers.get("authorization")))  # its own responses
            asked = dialect.parse(body, ParseContext(self._parsers.tool_calls, store))
            return await self._serve(request, asked, dialect, trace)
        except BaseException as e:  # refused before it began (a 400, 404, 503), or the client left: the span ends
            if trace is not None:
                trace.end(error=f"{type(e).__name__}: {e}"[:300])
            raise

    def count_message_tokens(self, body) -> dict:
        """Anthropic's count_tokens: the prompt a Messages request would have (max_tokens is not needed)."""
        p = parse_messages({**body, "max_tokens": 1} if isinstance(body, dict) else body, self._parsers.tool_calls)
        self.check_model(p.model)
        return {"input_tokens": len(self._tok.encode(self.render(p.chat_prompt), add_special_tokens=False))}

    def _trace(self, request: Request) -> RequestTrace | None:
        """The request's span (a child of the client's traceparent header, if any), its parse phase open."""
        if not self._tracer.enabled:
            return None
        trace = self._tracer.request(
            f"{request.method} {request.url.path}",
            request.headers.get("traceparent", ""),
            kind=KIND_SERVER,
            **{"gen_ai.request.model": self._limits.model_name},
        )
        trace.phase("parse")
        return trace

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self._tok.encode(prompt)
        bad = [t for t in prompt if not self._tok.is_valid_id(t)]
        if bad:
            raise bad_request(self._tok.id_range_error(bad[0]), param)
        return list(prompt)

    def _check_prompt_logprobs_budget(self, p: ParsedRequest, prompts: list[list[int]]) -> None:
        """A 400 where the prompt logprobs asked for would hold more entries in memory than allowed: each
        prompt token after the first has its own and the top k, for each of the n choices."""
        k = p.num_prompt_logprobs
        if k is None:
            return
        num_tokens = sum(len(ids) - 1 for ids in prompts)
        num_entries = num_tokens * (k + 1) * p.n
        limit = self._limits.max_prompt_logprobs_entries
        if num_entries > limit:
            param = "prompt_logprobs" if p.prompt_logprobs is not None else "logprobs"
            raise bad_request(
                f"{param}: {num_tokens} prompt tokens with logprobs x ({k} + 1) x n={p.n} is "
                f"{num_entries} entries, more than this server's limit of {limit} "
                "(gateway.max_prompt_logprobs_entries)",
                param,
            )

    def render(self, prompt: ChatPrompt) -> str:
        try:
            return self._tok.apply_chat_template(
                prompt.messages,
                prompt.add_generation_prompt,
                prompt.tools,
                prompt.continue_final_message,
                **prompt.template_kwargs,
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None

    def check_model(self, model: str | None) -> str:
        """The LoRA adapter ``model`` names ("" for the base model); a 404 for a model not served."""
        if model is not None and not isinstance(model, str):  # /tokenize and /detokenize pass it unparsed
            raise bad_request(f"model must be a string, got {type(model).__name__}", "model")
        return self.adapters.resolve(model)

    async def _serve(self, request: Request, asked: Asked, dialect: Dialect, trace: RequestTrace | None) -> object:
        arrival = time.monotonic()
        if trace is not None:
            trace.phase("tokenize")
        p, chat = asked.parsed, dialect.chat
        lora_name = self.check_model(p.model)
        p.sampling["lora_name"] = lora_name  # into every SamplingSpec of the request: the workers run it
        p.sampling["lora_path"] = self.adapters.paths.get(lora_name, "")
        if self._limits.cache_salt_per_api_key:  # key_salt.py: no prefix KV shared across API keys
            p.sampling["cache_salt"] = salt_for_key(api_key_of(request.headers), p.sampling.get("cache_salt", ""))
        if self.num_in_flight >= self._limits.max_concurrent_requests or not self._backend.has_capacity():
            self._metrics.requests.labels("rejected").inc()
            raise no_capacity(self._limits.retry_after_s)
        shape = ChatShape()
        if chat:
            prompt_text = self.render(p.chat_prompt)
            if asked.fit:
                prompt_text = self._fit(p, prompt_text)
            prompts = [self._tok.encode(prompt_text, add_special_tokens=False)]
            reasoning = REASONING_PARSERS[self._parsers.reasoning] if self._parsers.reasoning is not None else None
            opened = reasoning is not None and reasoning.prompt_opens(prompt_text)
            if opened and p.structured_output is not None:  # the workers gate the grammar on the end tag
                p.structured_output = replace(p.structured_output, after=reasoning.end)
            shape = self._chat_shape(p, opened)
        else:
            prompts = [self.tokenize_prompt(x) for x in p.prompts]
        prompts = [truncate_prompt(ids, p.truncate_prompt_tokens, self._limits.max_model_len) for ids in prompts]
        self._check_prompt_logprobs_budget(p, prompts)
        for name, ids in (
            ("logit_bias", [b.token_id for b in p.sampling["logit_bias"]]),
            ("allowed_token_ids", p.sampling["allowed_token_ids"] or []),
        ):
            bad = [t for t in ids if not self._tok.is_valid_id(t)]
            if bad:
                raise bad_request(f"{name} {self._tok.id_range_error(bad[0])}", name)
        # checked by the RequestIdEcho middleware (a malformed one never gets here)
        given = request.headers.get(REQUEST_ID_HEADER) if dialect.keeps_request_id else None
        rid = dialect.id_prefix + (given or uuid.uuid4().hex)
        backend_rid = dialect.worker_rid(rid, given)
        requests, states = self._fan_out(backend_rid, p, prompts, chat, arrival, trace)
        if trace is not None:
            trace.set(**{"gen_ai.request.id": backend_rid if dialect.private_ids else rid})
            trace.phase("generate")  # routing (a "route" span per prompt), queueing, prefill: up to the first token
        opts = ResponseOptions(
            p.logprobs, p.prompt_logprobs, p.n, self._echo_texts(p, prompts) if p.echo else None, shape
        )
        generation = Generation(self._backend, requests, states, self._metrics, p.n, request_id=rid)
        served_as = lora_name or self._limits.model_name  # the adapter's name answers as the model, as vLLM's
        out = asked.output(
            OutputContext(
                rid, int(time.time()), served_as, len(states), shape, self._formats[p.tokens_as_ids], opts, self._tok
            )
        )
        self.num_in_flight += 1
        self._metrics.num_requests_running.inc()
        if asked.background:
            return self._answer_in_background(generation, out, asked.keep, rid, arrival)
        starting = asyncio.ensure_future(generation.start())
        patience_s = self._limits.sse_keepalive_s if p.stream else None  # JSON answers wait for the start
        try:
            started = await self._start(request, generation, starting, patience_s)
        except APIError as e:
            await self._close(generation, arrival, "rejected" if e.status == 503 else "failed")
            raise
        if started is None:
            await self._close(generation, arrival, "aborted")
            return JSONResponse({}, status_code=499)  # the client left; nobody reads this
        if trace is not None:
            trace.phase("stream")
        if p.stream:
            return EventStreamResponse(
                self._stream(generation, out, rid, arrival, None if started else starting),
                on_close=lambda: self._close(generation, arrival, "aborted", starting),
                keepalive_s=self._limits.sse_keepalive_s,
            )
        if not await self._collect(request, generation, arrival):
            return JSONResponse({}, status_code=499)  # the client left; nobody reads this
        return JSONResponse(out.whole(generation.states))

    def _answer_in_background(
        self, generation: Generation, builder: StoredOutput, keep: Callable[[dict], object], rid: str, arrival: float
    ) -> JSONResponse:
        """The response, ``queued``, now; its generation goes on in the background
        (gateway/dialects/responses/background.py)."""
        queued = {**builder.body(), "status": "queued"}
        keep(queued)
        self.background.start(rid, self._generate_in_background(generation, builder, keep, arrival))
        return JSONResponse(queued)

    async def _generate_in_background(
        self, generation: Generation, builder: StoredOutput, keep: Callable[[dict], object], arrival: float
    ) -> None:
        """Runs the generation to its end, storing the response in_progress once the workers have it, then
        as it ended (``builder`` stores what it finishes); cancelled, it is stored cancelled."""
        outcome = "aborted"
        try:
            await generation.start()
            keep(builder.body())  # in_progress
            async for _ in generation.deltas():
                pass
            builder.whole(generation.states)
            outcome = "success"
        except asyncio.CancelledError:
            keep({**builder.body(), "status": "cancelled"})
            raise
        except APIError as e:
            builder.failure(e)
            outcome = "rejected" if e.status == 503 else "failed"
        except Exception:
            log.exception("background response %s failed", builder.body()["id"])
            builder.failure(APIError(500, "internal server error", code="internal_error"))
            outcome = "failed"
        finally:
            await self._close(generation, arrival, outcome)

    def _fit(self, p: ParsedRequest, prompt_text: str) -> str:
        """truncation "auto": the prompt without the earliest turns that leave no room for the answer (at
        least one token, or max_output_tokens). Where even the last turn does not fit, the prompt as it
        is, which resolve_max_tokens refuses with both numbers."""
        limit = self._limits.max_model_len - (p.max_tokens or 1)
        # every candidate is the leading system message plus a suffix of the rest: its length names it
        rendered = {len(p.chat_prompt.messages): prompt_text}

        def prompt_len(messages: list[dict]) -> int:
            if len(messages) not in rendered:
                rendered[len(messages)] = self.render(replace(p.chat_prompt, messages=messages))
            return len(self._tok.encode(rendered[len(messages)], add_special_tokens=False))

        kept = fit_conversation(p.chat_prompt.messages, prompt_len, limit)
        if kept is None:
            return prompt_text
        p.chat_prompt = replace(p.chat_prompt, messages=kept)
        return rendered[len(kept)]

    def _chat_shape(self, p: ParsedRequest, opened: bool) -> ChatShape:
        """With a reasoning parser, the reasoning is split off. A structured output (a forced tool call
        included) applies after it where the prompt opens it, as in vLLM; otherwise the grammar holds
        from the first token, so there is no thinking to split. ``opened``: the prompt opens it."""
        split = p.structured_output is None or opened
        return ChatShape(self._parsers.reasoning if split else None, opened, p.include_reasoning, p.tool_choice)

    def _echo_texts(self, p: ParsedRequest, prompts: list[list[int]]) -> list[str] | None:
        """Completions: the prompt as sent, a token-id prompt decoded with its special tokens, as vLLM
        echoes it. Chat: the last message's content where it is the assistant's (vLLM's chat echo), else
        none."""
        if p.chat_prompt is not None:
            last = p.chat_prompt.messages[-1]
            wanted = last.get("role") == "assistant" and isinstance(last.get("content"), str)
            return [last["content"]] if wanted else None
        return [
            sent if isinstance(sent, str) else self._tok.decode(ids, skip_special_tokens=False)
            for sent, ids in zip(p.prompts, prompts)
        ]

    def _fan_out(
        self,
        rid: str,
        p: ParsedRequest,
        prompts: list[list[int]],
        chat: bool,
        arrival: float,
        trace: RequestTrace | None = None,
    ):
        deadline = arrival + self._limits.request_timeout_s if self._limits.request_timeout_s else None
        requests, states = [], []
        for prompt_index, ids in enumerate(prompts):
            max_tokens = resolve_max_tokens(p.max_tokens, len(ids), self._limits.max_model_len, chat)
            request_id = f"{rid}-{prompt_index}"
            requests.append(
                GenerationRequest(request_id, ids, p.sampling_options(max_tokens), arrival, deadline, trace)
            )
            for j in range(p.n):  # choice prompt_index * n + j is completion j of that request
                states.append(
                    ChoiceState(
                        prompt_index * p.n + j,
                        request_id,
                        self._tok,
                        ids,
                        p.stop,
                        p.skip_special_tokens,
                        p.sampling["stop_token_ids"],
                        p.include_stop_str,
                    )
                )
        return requests, states

    async def _start(
        self, request: Request, generation: Generation, starting: asyncio.Future, patience_s: float | None
    ) -> bool | None:
        """Waits for ``starting`` (``generation.start()``: up to every request's first event) while watching
        the client: True once started; None where the client left first (a long queue or prefill), its
        requests aborted so the workers let go then, not at the first token; False where it is still
        starting after ``patience_s`` (a stream then begins, keeping the client with keep-alives)."""
        left = False
        failure: list[Exception] = []  # kept out of the task group, which would wrap it in an ExceptionGroup
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal left
                await wait_for_disconnect(request.receive)
                left = True
                with anyio.CancelScope(shield=True):  # start may return (its requests ended) meanwhile
                    await generation.abort()
                    await asyncio.wait([starting])

            tg.start_soon(watch)
            with anyio.move_on_after(patience_s if patience_s else math.inf):
                try:
                    await asyncio.shield(starting)
                except Exception as e:
                    failure.append(e)
            tg.cancel_scope.cancel()
        if left:
            return None
        if failure:
            raise failure[0]
        return starting.done()

    async def _collect(self, request: Request, generation: Generation, arrival: float) -> bool:
        """Runs the generation to its end: True once every choice finished, False if the client left."""
        outcome = "aborted"
        failure: list[APIError] = []  # kept out of the task group, which would wrap it in an ExceptionGroup
        try:
            async with anyio.create_task_group() as tg:

                async def drain() -> None:
                    try:
                        async for _ in generation.deltas():
                            pass
                    except APIError as e:
                        failure.append(e)
                    tg.cancel_scope.cancel()

                tg.start_soon(drain)
                await wait_for_disconnect(request.receive)
                tg.cancel_scope.cancel()  # client gone: nobody will read the answer
            if failure:
                outcome = "failed"
                raise failure[0]
            if not all(s.is_finished for s in generation.states):
                return False
            outcome = "success"
        finally:
            await self._close(generation, arrival, outcome)
        return True

    async def _stream(
        self,
        generation: Generation,
        out: OutputBuilder,
        rid: str,
        arrival: float,
        starting: asyncio.Future | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """SSE frames from ``out``: its opening, its frames of each delta, then its closing, or its
        failure (headers are gone by then: the only way left to tell the client is in-band).
        ``starting``: the generation's start, where the stream began before it ended."""
        outcome = "aborted"
        try:
            if starting is not None:
                try:
                    await starting
                except APIError as e:
                    outcome = "rejected" if e.status == 503 else "failed"
                    for frame in out.failure(e):
                        yield frame
                    return
            for frame in out.opening(generation.states):
                yield frame
            try:
                async for index, delta in generation.deltas():
                    for frame in out.frames(generation.states[index], delta):
                        yield frame
                frames, outcome = out.closing(generation.states), "success"
            except APIError as e:
                frames, outcome = out.failure(e), "failed"
            except Exception:
                log.exception("stream %s failed", rid)
                frames, outcome = out.failure(APIError(500, "internal server error", code="internal_error")), "failed"
            for frame in frames:
                yield frame
        finally:
            await self._close(generation, arrival, outcome, starting)

    async def _close(
        self, generation: Generation, arrival: float, outcome: str, starting: asyncio.Future | None = None
    ) -> None:
        """Release the backend requests and count the outcome, once, whoever gets here first. ``starting``:
        the generation's start, ended first where it still runs (a stream its client left while queued)."""
        if starting is not None and not starting.done():
            starting.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([starting])
        if await generation.close():
            self._finish(generation, arrival, outcome)

    def _finish(self, generation: Generation, arrival: float, outcome: str) -> None:
        m = self._metrics
        self.num_in_flight -= 1
        m.num_requests_running.dec()
        m.requests.labels(outcome).inc()
        m.e2e_request_latency.observe(time.monotonic() - arrival)
        counts = usage(generation.states, generation.num_choices_per_prompt)  # a prompt counts once, as in usage
        m.generation_tokens.inc(counts["completion_tokens"])
        m.prompt_tokens.inc(counts["prompt_tokens"])
        m.cached_prompt_tokens.inc(counts["prompt_tokens_details"]["cached_tokens"])
        if outcome in ("success", "aborted"):
            m.request_prompt_tokens.observe(counts["prompt_tokens"])
            m.request_generation_tokens.observe(counts["completion_tokens"])
        timings = generation.timings()
        m.observe_choices(arrival, timings, aborted=outcome == "aborted")
        report = RequestReport.of(
            generation.request_id,
            self._limits.model_name,
            outcome,
            counts,
            timings,
            generation.worker_ids,
            arrival,
            time.monotonic(),
        )
        log.info("%s", report.log_line())
        if generation.trace is not None:
            generation.trace.end(report.error, **report.span_attributes())
