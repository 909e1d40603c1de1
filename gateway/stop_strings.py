"""Stop strings over streamed text: a stop string never reaches the client, even when it arrives split
across several deltas. Text that could still be the start of a stop string is held back:

    text:  "... emitted ... | held: a suffix that is a prefix of some stop string"
"""

from __future__ import annotations


class StopStringMatcher:
    """``push(delta)`` returns (text safe to emit, stopped?); after a stop the matcher takes nothing more."""

    __slots__ = ("_stops", "_pending", "stopped")

    def __init__(self, stop: list[str]) -> None:
        self._stops = [s for s in stop if s]
        self._pending = ""  # text received but not yet emitted
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string matched"
        if not self._stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)], True
        held = self._held_suffix_len(text)
        self._pending = text[len(text) - held:]
        return text[: len(text) - held], False

    def flush(self) -> str:
        """At the end of generation the held text was not a stop string after all."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix_len(self, text: str) -> int:
        # longest suffix of text that is a proper prefix of a stop string
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
