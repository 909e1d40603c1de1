"""OpenAI response bodies and stream chunks for completions and chat, built from choice states/deltas."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.http.errors import APIError
from gateway.http.sse import DONE, error_event, sse_event
from gateway.serving.choice import ChoiceDelta, ChoiceState
from gateway.text.chat_output import ChatOutput, ChatShape, chat_message
from gateway.text.tokenizer import Tokenizer
from gateway.workers.backend import TokenLogprob


@dataclass(slots=True)
class ResponseOptions:
    """What the client asked to see besides the generated text; fixed once the request is tokenized."""

    logprobs: int | None  # top alternatives per token; None: no logprobs
    prompt_logprobs: int | None  # vLLM's prompt_logprobs, asked for explicitly; None: no such field
    num_choices_per_prompt: int = 1  # n: choice i answers prompt i // n
    # echo: the text put before each prompt's choices (completions: the prompt; chat: the last message)
    echo_texts: list[str] | None = None
    chat_shape: ChatShape = ChatShape()  # chat: how the text is read into reasoning, content and tool calls

    def echo_of(self, index: int) -> str | None:
        """The echo that leads choice ``index``."""
        return None if self.echo_texts is None else self.echo_texts[index // self.num_choices_per_prompt]


def usage(states: list[ChoiceState], n: int) -> dict:
    """A prompt is counted once however many choices it has; cached tokens from its first choice."""
    firsts = states[::n]
    prompt = sum(s.num_prompt_tokens for s in firsts)
    completion = sum(s.num_output_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in firsts)},
    }


MIN_LOGPROB = -9999.0  # vLLM's floor: a token the grammar or a bias rules out has -inf, which JSON cannot carry


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class LogprobFormatter:
    """Token strings for logprobs; a lone byte-level token may decode to U+FFFD, as in vLLM and OpenAI.
    ``tokens_as_ids`` (vLLM's return_tokens_as_token_ids): each token is "token_id:<id>" instead, which
    names it exactly where its text cannot."""

    __slots__ = ("_tok", "_as_ids")

    def __init__(self, tokenizer: Tokenizer, tokens_as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._as_ids = tokens_as_ids

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._text(token_id)

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self._token(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

        content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def completion(self, entries: list[TokenLogprob], text_offset: int) -> dict:
        return self._completion([(e.token_id, e) for e in entries], text_offset)

    def echoed_completion(
        self, state: ChoiceState, echo: str, k: int, entries: list[TokenLogprob], text_offset: int
    ) -> dict:
        """``completion`` of an echoed prompt, then of ``entries``: the prompt's first token has no logprob
        (None, as in vLLM), the others their own top ``k``. ``entries`` start where the prompt's text ends,
        so their offsets stay right whatever the prompt's tokens decode to one by one."""
        head = self._completion(
            [(state.prompt_ids[0], None)]
            + [(e.token_id, TokenLogprob(e.token_id, e.logprob, e.top[:k])) for e in state.prompt_logprobs],
            text_offset,
        )
        tail = self.completion(entries, text_offset + len(echo))
        return {key: head[key] + tail[key] for key in head}

    def _completion(self, steps: list[tuple[int, TokenLogprob | None]], text_offset: int) -> dict:
        """OpenAI's legacy logprobs object over (token id, its logprob or None) steps."""
        tokens, offsets = [], []
        for token_id, _ in steps:
            offsets.append(text_offset)
            tokens.append(self._token(token_id))
            text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _logprob(e.logprob) for _, e in steps],
            "top_logprobs": [
                None if e is None else {self._token(t): _logprob(lp) for t, lp in e.top} for _, e in steps
            ],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, entries: list[TokenLogprob], k: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then for each one a map from token id to
        logprob, rank and text holding the prompt token and the top ``k`` (the prompt token once)."""

        def one(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": self._text(token_id)}

        out: list[dict | None] = [None]
        for e in entries:
            ranked = {str(e.token_id): one(e.token_id, e.logprob, e.rank)}
            for rank, (token_id, logprob) in enumerate(e.top[:k], start=1):
                ranked.setdefault(str(token_id), one(token_id, logprob, rank))
            out.append(ranked)
        return out


def _completion_logprobs(
    fmt: LogprobFormatter,
    opts: ResponseOptions,
    state: ChoiceState,
    echo: str | None,
    entries: list[TokenLogprob],
    text_offset: int,
) -> dict | None:
    """Logprobs of one choice's text or of one chunk of it; ``echo``: the prompt text leads this part."""
    if opts.logprobs is None:
        return None
    if echo is None:
        return fmt.completion(entries, text_offset)
    return fmt.echoed_completion(state, echo, opts.logprobs, entries, text_offset)


def completion_body(
    rid: str, created: int, model: str, states: list[ChoiceState], fmt: LogprobFormatter, opts: ResponseOptions
) -> dict:
    choices = []
    for s in states:
        echo = opts.echo_of(s.index)
        choice = {
            "index": s.index,
            "text": (echo or "") + s.text,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            "logprobs": _completion_logprobs(fmt, opts, s, echo, s.logprobs, 0),
        }
        if opts.prompt_logprobs is not None:
            choice["prompt_logprobs"] = fmt.prompt_logprobs(s.prompt_logprobs, opts.prompt_logprobs)
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(states, opts.num_choices_per_prompt),
    }


def chat_body(
    rid: str, created: int, model: str, states: list[ChoiceState], fmt: LogprobFormatter, opts: ResponseOptions
) -> dict:
    want_logprobs = opts.logprobs is not None
    choices = []
    for s in states:
        message, finish_reason = chat_message(opts.chat_shape, s.text, s.finish_reason)
        if (echo := opts.echo_of(s.index)) is not None:
            message["content"] = echo + (message["content"] or "")
        choices.append(
            {
                "index": s.index,
                "message": message,
                "finish_reason": finish_reason,
                "stop_reason": s.stop_reason,
                "logprobs": fmt.chat(s.logprobs) if want_logprobs else None,
            }
        )
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(states, opts.num_choices_per_prompt),
    }
    if opts.prompt_logprobs is not None:  # one prompt, so one list for the response, as vLLM places it
        body["prompt_logprobs"] = fmt.prompt_logprobs(states[0].prompt_logprobs, opts.prompt_logprobs)
    return body


class ChunkBuilder:
    """One completion or chat response (serving's OutputBuilder): its body whole, or its stream chunks;
    tracks each choice's text offset for completion logprobs, and
    whether its echoed prompt went out yet (with its first chunk)."""

    __slots__ = (
        "_rid",
        "_created",
        "_model",
        "_chat",
        "_fmt",
        "_opts",
        "_offsets",
        "_has_echoed",
        "_outputs",
        "_include_usage",
        "_continuous_usage",
    )

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        chat: bool,
        fmt: LogprobFormatter,
        opts: ResponseOptions,
        num_choices: int,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        self._rid, self._created, self._model, self._chat = rid, created, model, chat
        self._fmt, self._opts, self._include_usage = fmt, opts, include_usage
        self._continuous_usage = include_usage and continuous_usage  # vLLM's: only along with include_usage
        self._offsets = [0] * num_choices
        self._has_echoed = [False] * num_choices
        self._outputs = [ChatOutput(opts.chat_shape) for _ in range(num_choices)] if chat else []

    def whole(self, states: list[ChoiceState]) -> dict:
        """The response of a non-streamed request, once every choice finished."""
        build = chat_body if self._chat else completion_body
        return build(self._rid, self._created, self._model, states, self._fmt, self._opts)

    # ---- the stream (serving's StreamBuilder: each returns SSE frames) ----
    def opening(self, states: list[ChoiceState]) -> list[bytes]:
        """Chat: a role chunk per choice first."""
        return [sse_event(self._counted(self.role(s.index), s)) for s in states] if self._chat else []

    def frames(self, state: ChoiceState, d: ChoiceDelta) -> list[bytes]:
        chunk = None if d.is_empty else self.delta(state, d)
        return [sse_event(self._counted(chunk, state))] if chunk is not None else []

    def _counted(self, chunk: dict, state: ChoiceState) -> dict:
        """With continuous usage, the chunk's choice's usage so far (vLLM counts per choice)."""
        if self._continuous_usage:
            chunk["usage"] = usage([state], 1)
        return chunk

    def closing(self, states: list[ChoiceState]) -> list[bytes]:
        return ([sse_event(self.usage(states))] if self._include_usage else []) + [DONE]

    def failure(self, e: APIError) -> list[bytes]:
        return [error_event(e), DONE]

    def _wrap(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {
            "id": self._rid,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk

    def role(self, index: int) -> dict:
        """Chat only: the first chunk of each choice names the role."""
        return self._wrap(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": self._opts.echo_of(index) or ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta(self, state: ChoiceState, d: ChoiceDelta) -> dict | None:
        """The chunk of ``d``; None where a chat parser holds all of its text back and nothing else is new."""
        index = state.index
        if self._chat:
            logprobs = self._fmt.chat(d.logprobs) if self._opts.logprobs is not None else None
            delta, finish_reason = self._outputs[index].feed(d.text, d.finish_reason)
            if not (delta or finish_reason or logprobs):
                return None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = state.stop_reason
            return self._wrap([choice])
        echo = None if self._has_echoed[index] else self._opts.echo_of(index)
        self._has_echoed[index] = True
        logprobs = _completion_logprobs(self._fmt, self._opts, state, echo, d.logprobs, self._offsets[index])
        text = (echo or "") + d.text
        self._offsets[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = state.stop_reason
        return self._wrap([choice])

    def usage(self, states: list[ChoiceState]) -> dict:
        return self._wrap([], usage(states, self._opts.num_choices_per_prompt))
