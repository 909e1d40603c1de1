"""Stop strings over streamed text: a stop string never reaches the client, even when it arrives split
across several deltas. Text that could still be the start of a stop string is held back:

    text:  "... emitted ... | held: a suffix that is a prefix of some stop string"

The same holding back finds the tags of reasoning and tool calls in streamed text (``cut_at``).
"""

from __future__ import annotations


class StopStringMatcher:
    """``push(delta)`` returns (text safe to emit, stopped?); after a stop the matcher takes nothing more.
    ``include``: the stop string itself is emitted too (vLLM's include_stop_str_in_output)."""

    __slots__ = ("_stops", "_include", "_pending", "stopped", "matched")

    def __init__(self, stop: list[str], include: bool = False) -> None:
        self._stops = [s for s in stop if s]
        self._include = include
        self._pending = ""  # text received but not yet emitted
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def push(self, delta: str) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string matched"
        if not self._stops:
            return delta, False
        text = self._pending + delta
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._pending = ""
            return text[: at + (len(self.matched) if self._include else 0)], True
        held = held_suffix_len(text, self._stops)
        self._pending = text[len(text) - held :]
        return text[: len(text) - held], False

    def flush(self) -> str:
        """At the end of generation the held text was not a stop string after all."""
        text, self._pending = self._pending, ""
        return text


def held_suffix_len(text: str, strings: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``strings``: the part
    to hold back, since the next delta may complete it."""
    best = 0
    for s in strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def cut_at(text: str, tag: str, final: bool) -> tuple[str, str, bool]:
    """(head, rest, found) of streamed ``text`` at ``tag``: found, head is the text before it and rest the
    text after it; not found, head is the text that cannot begin the tag and rest is held back for the
    next delta (nothing is held back once ``final``)."""
    at = text.find(tag)
    if at >= 0:
        return text[:at], text[at + len(tag) :], True
    held = 0 if final else held_suffix_len(text, [tag])
    return text[: len(text) - held], text[len(text) - held :], False
