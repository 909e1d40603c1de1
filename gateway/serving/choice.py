"""One choice of a response: token events in, client-visible text deltas out.

Per event: ids -> incremental detokenizer -> stop-string matcher -> delta. Logprobs of tokens whose text
is still held back wait for the next delta, so no chunk ever goes out empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import Tokenizer
from gateway.workers.backend import CompletionEvent, TokenLogprob


@dataclass(slots=True)
class ChoiceDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once the choice is over
    stopped_by_string: bool = False  # the gateway ended it: the worker must be told to abort

    @property
    def is_empty(self) -> bool:
        return not self.text and self.finish_reason is None


class ChoiceState:
    """Text, token count and finish reason of one choice (one backend request)."""

    __slots__ = (
        "index",
        "request_id",
        "prompt_ids",
        "num_output_tokens",
        "num_cached_tokens",
        "text",
        "finish_reason",
        "prompt_logprobs",
        "_detok",
        "_stop",
        "_stop_token_ids",
        "_last_token_id",
        "_held_logprobs",
        "_all_logprobs",
    )

    def __init__(
        self,
        index: int,
        request_id: str,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        stop_token_ids: list[int] = (),
        include_stop_str: bool = False,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.text = ""  # everything emitted so far (an echoed prompt is the response's business, not in here)
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None  # when asked: one per prompt token after the first
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = StopStringMatcher(stop, include_stop_str)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._last_token_id: int | None = None
        self._held_logprobs: list[TokenLogprob] = []
        self._all_logprobs: list[TokenLogprob] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string or the stop token id (of stop_token_ids) that ended the
        choice; None where it ended otherwise (EOS, length)."""
        if self._stop.matched is not None:
            return self._stop.matched
        if self.finish_reason == "stop" and self._last_token_id in self._stop_token_ids:
            return self._last_token_id
        return None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self._all_logprobs

    def feed(self, event: CompletionEvent) -> ChoiceDelta:
        assert not self.is_finished, f"event after finish for {self.request_id}"
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.num_output_tokens += len(event.token_ids)
        if event.token_ids:
            self._last_token_id = event.token_ids[-1]
        if event.logprobs:
            self._held_logprobs.extend(event.logprobs)
            self._all_logprobs.extend(event.logprobs)
        text = self._detok.add(event.token_ids, stopped=event.finish_reason == "stop")
        if event.finish_reason is not None:
            text += self._detok.flush()
        emit, stopped = self._stop.push(text)
        if stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            emit += self._stop.flush()
            self.finish_reason = event.finish_reason
        self.text += emit
        delta = ChoiceDelta(emit, finish_reason=self.finish_reason, stopped_by_string=stopped)
        if emit or self.is_finished:
            delta.logprobs, self._held_logprobs = self._held_logprobs, []
        return delta
