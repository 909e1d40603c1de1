"""OpenAI response bodies and stream chunks for completions and chat, built from choice states/deltas."""

from __future__ import annotations

from .backend import TokenLogprob
from .choice import ChoiceDelta, ChoiceState
from .tokenizer import Tokenizer


def usage(states: list[ChoiceState], n: int) -> dict:
    """A prompt is counted once however many choices it has; cached tokens from its first choice."""
    firsts = states[::n]
    prompt = sum(s.num_prompt_tokens for s in firsts)
    completion = sum(s.num_output_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in firsts)}}


class LogprobFormatter:
    """Token strings for logprobs; a lone byte-level token may decode to U+FFFD, as in vLLM and OpenAI."""

    __slots__ = ("_tok",)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def _token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def completion(self, entries: list[TokenLogprob], text_offset: int) -> dict:
        tokens, offsets = [], []
        for e in entries:
            offsets.append(text_offset)
            tokens.append(self._token(e.token_id))
            text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def completion_body(rid: str, created: int, model: str, states: list[ChoiceState], n: int,
                    fmt: LogprobFormatter, want_logprobs: bool) -> dict:
    choices = [{"index": s.index, "text": s.text, "finish_reason": s.finish_reason,
                "logprobs": fmt.completion(s.logprobs, 0) if want_logprobs else None} for s in states]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(states, n)}


def chat_body(rid: str, created: int, model: str, states: list[ChoiceState], n: int,
              fmt: LogprobFormatter, want_logprobs: bool) -> dict:
    choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason,
                "logprobs": fmt.chat(s.logprobs) if want_logprobs else None} for s in states]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(states, n)}


class ChunkBuilder:
    """Stream chunks of one response; tracks each choice's text offset for completion logprobs."""

    __slots__ = ("_rid", "_created", "_model", "_chat", "_fmt", "_want_logprobs", "_offsets")

    def __init__(self, rid: str, created: int, model: str, chat: bool, fmt: LogprobFormatter,
                 want_logprobs: bool, num_choices: int) -> None:
        self._rid, self._created, self._model, self._chat = rid, created, model, chat
        self._fmt, self._want_logprobs = fmt, want_logprobs
        self._offsets = [0] * num_choices

    def _wrap(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self._rid, "object": "chat.completion.chunk" if self._chat else "text_completion",
                 "created": self._created, "model": self._model, "choices": choices}
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk

    def role(self, index: int) -> dict:
        """Chat only: the first chunk of each choice names the role."""
        return self._wrap([{"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}])

    def delta(self, index: int, d: ChoiceDelta) -> dict:
        logprobs = None
        if self._want_logprobs:
            logprobs = (self._fmt.chat(d.logprobs) if self._chat
                        else self._fmt.completion(d.logprobs, self._offsets[index]))
        self._offsets[index] += len(d.text)
        if self._chat:
            choice = {"index": index, "delta": {"content": d.text} if d.text else {}, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}
        else:
            choice = {"index": index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        return self._wrap([choice])

    def usage(self, states: list[ChoiceState], n: int) -> dict:
        return self._wrap([], usage(states, n))
