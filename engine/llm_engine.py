"""The in-process engine: requests in, finished sequences out, one scheduler step at a time.

Life cycle of a request here:
1. ``add_request`` validates the prompt against the context, makes its Sequence (stop ids = the
   request's plus the model's EOS unless ``ignore_eos``; the matcher of its structured output) and
   queues it.
2. ``step`` asks the scheduler for a batch (prefill chunks and decode tokens), the runner computes it
   and samples, the scheduler appends the tokens, checks stops and frees finished sequences' blocks.
3. Finished sequences are reported grouped by request: a request with ``n > 1`` finishes when all its
   completions have.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.lora.adapter import LoRAError
from engine.model.config import HFModelConfig
from engine.sampling.grammar_compiles import CompileTicket
from engine.sampling.params import SamplingParams
from engine.sampling.structured_output import Grammars, StructuredOutputError
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Sequence, SequenceStatus, vocab_error
from engine.step.runner import ModelRunner

NO_GRAMMARS = "structured outputs need the model's tokenizer; this engine has none"

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list | None = None  # one TokenLogprobs per token when asked
    text: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens taken from the prefix cache, not recomputed
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list | None = None  # when asked: None for token 0, then a TokenLogprobs per prompt token


@dataclass(slots=True)
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    finished: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self, model_config: HFModelConfig, scheduler: Scheduler, runner: ModelRunner, grammars: Grammars | None = None
    ):
        """``grammars``: compiles structured outputs against the model's tokenizer; None refuses them."""
        self.model_config = model_config
        self.scheduler = scheduler
        self.runner = runner
        self.grammars = grammars
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.num_computed_tokens = 0  # tokens run through the model (prefill chunks + decodes), all time

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        if error := vocab_error(prompt_token_ids, params, self.model_config.vocab_size) or self.lora_error(params):
            raise ValueError(error)
        request_id = next(self._ids)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            stop_token_ids=params.stop_ids(self.model_config.eos_token_ids),
            guide=self.new_guide(params),
        )
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(list(prompt_token_ids), params)
        return request_id

    def lora_error(self, params: SamplingParams) -> str:
        """Empty when this engine serves the adapter ``params`` names (or none), else the reason. When
        empty, ``params.lora_adapter`` holds the weights the request runs with to its end (pinned: an
        unload, an eviction or a rewrite of its directory meanwhile does not touch them)."""
        if not params.lora_name:
            return ""
        if self.runner.lora is None:
            return f"LoRA adapter {params.lora_name!r} requested; this worker serves no adapters (--enable-lora)"
        if error := self.runner.lora.check(params.lora_name, params.lora_path):
            return error
        try:
            params.lora_adapter = self.runner.lora.pin(params.lora_name)
        except LoRAError as exc:
            return str(exc)
        return ""

    def new_guide(self, params: SamplingParams):
        """The Guide of ``params.structured_output`` for a new sequence (None without one); raises
        StructuredOutputError for a grammar that does not compile."""
        if params.structured_output is None:
            return None
        if self.grammars is None:
            raise StructuredOutputError(NO_GRAMMARS)
        return self.grammars.guide(params.structured_output)

    def new_guide_async(self, params: SamplingParams) -> Future | CompileTicket:
        """``new_guide(params)`` for a structured output, compiled off the caller's thread
        (Grammars.guide_async); the future raises StructuredOutputError where new_guide would."""
        assert params.structured_output is not None
        if self.grammars is None:
            refused: Future = Future()
            refused.set_exception(StructuredOutputError(NO_GRAMMARS))
            return refused
        return self.grammars.guide_async(params.structured_output)

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        sampled = self.runner.execute(batch)
        self.num_computed_tokens += sum(batch.num_new_tokens)
        finished = self.scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs, sampled.accepted)
        return [out for seq in finished if (out := self._on_finished(seq)) is not None]

    def _on_finished(self, seq: Sequence) -> RequestOutput | None:
        request_id = self.scheduler.request_id_of(seq)
        request = self._requests[request_id]
        request.finished.append(seq)
        if len(request.finished) < request.params.n:
            return None
        del self._requests[request_id]
        request.finished.sort(key=self.scheduler.completion_index_of)
        first = request.finished[0]
        output = RequestOutput(request_id, request.prompt_token_ids, first.num_cached_tokens)
        if request.params.prompt_logprobs is not None:
            output.prompt_logprobs = [None, *first.prompt_logprobs]
        for index, done in enumerate(request.finished):
            logprobs = done.output_logprobs if request.params.logprobs is not None else None
            output.outputs.append(CompletionOutput(index, done.output_token_ids, FINISH_REASONS[done.status], logprobs))
        return output
