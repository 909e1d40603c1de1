"""A thinking model's ``<think>...</think>``: the reasoning before ``</think>``, the content after it.

Both parsers vLLM users name for these tags, ``deepseek_r1`` and ``qwen3``, read the same shape:

    [<think>] reasoning ... </think> content ...

The reasoning is open from the first token when the output starts with ``<think>`` or when the prompt
itself ends with it (DeepSeek-R1's and newer Qwen templates put it there); otherwise, as with Qwen3's
``enable_thinking: false``, everything is content. A reasoning never closed (cut by max_tokens) stays
reasoning. Streamed, a tag split across deltas is held back until it is complete.
"""

from __future__ import annotations

from gateway.text.stop_strings import cut_at

from .base import ReasoningParser

START, END = "<think>", "</think>"


class ThinkTagParser(ReasoningParser):
    """One choice's text, split as it streams: ``feed(text, final)`` -> (reasoning, content) of it."""

    end = END

    __slots__ = ("_state", "_opened_by_prompt", "_pending")

    @staticmethod
    def prompt_opens(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(START)

    def __init__(self, opened_by_prompt: bool) -> None:
        self._state = "start"  # "start" (before the first non-space text) | "reasoning" | "content"
        self._opened_by_prompt = opened_by_prompt
        self._pending = ""  # held back: leading space, or what may still become a tag

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        pending, self._pending = self._pending + text, ""
        reasoning = ""
        if self._state == "start":
            lead = pending.lstrip()
            if lead.startswith(START):
                self._state, pending = "reasoning", lead[len(START) :]
            elif START.startswith(lead) and not final:
                self._pending = pending  # maybe the start of the tag: wait for more
                return "", ""
            else:
                self._state = "reasoning" if self._opened_by_prompt else "content"
        if self._state == "reasoning":
            reasoning, pending, closed = cut_at(pending, END, final)
            if not closed:
                self._pending = pending
                return reasoning, ""
            self._state = "content"
        return reasoning, pending
