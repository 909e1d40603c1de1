"""Bounds on compiling requests' grammars: a deadline per compile, a few threads, a bounded cache.

xgrammar cannot stop a compile once started, and a 64 KB grammar against a large vocabulary may take
minutes. So a request waits for its compile only until its deadline (counted from its submission, once
the tokenizer is loaded: the first compile's one-time load is not the request's doing); past it, the
request is refused with the limit named, and the compile is left to end on its thread, unread. A
request aborted before its compile started cancels it. xgrammar's cache of compiled grammars keeps
the most recently used under a byte budget: unbounded, each unique grammar a client sends stays in memory
(xgrammar's GHSA-389x-67px-mjg3; vLLM bounds it at 512 MB, VLLM_XGRAMMAR_CACHE_MB, as we do).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    compile_timeout_s: float = 30.0  # engine.grammar_compile_timeout_s
    cache_bytes: int = 512 << 20  # engine.grammar_cache_mb: xgrammar's LRU cache of compiled grammars; -1: unbounded
    num_threads: int = 2  # engine.grammar_compile_threads: compiles running at once

    def __post_init__(self) -> None:
        assert self.compile_timeout_s > 0 and self.num_threads >= 1, self


class StructuredOutputError(ValueError):
    """A grammar that does not compile, or not in time; the message says why (xgrammar's words, without
    its source path). Re-exported by engine/sampling/structured_output.py, where it is raised most."""


class CompileTicket:
    """A compile's Future with a deadline: ``done`` once the compile ended or the deadline passed;
    ``result`` then gives the guide, or raises the compile's StructuredOutputError, or one naming the
    time limit."""

    __slots__ = ("_future", "_submitted", "_timeout_s", "_loaded_at")

    def __init__(self, future: Future, timeout_s: float, loaded_at) -> None:
        self._future = future
        self._submitted = time.monotonic()
        self._timeout_s = timeout_s
        self._loaded_at = loaded_at  # () -> monotonic time the tokenizer finished loading, or None

    def is_expired(self) -> bool:
        loaded = self._loaded_at()
        return loaded is not None and time.monotonic() > max(self._submitted, loaded) + self._timeout_s

    def done(self) -> bool:
        return self._future.done() or self.is_expired()

    def result(self):
        if not self._future.done():
            if not self.is_expired():
                raise RuntimeError("result() before done()")
            if not self._future.cancel():
                log.warning(
                    "a grammar compile ran past its %.1f s limit; it ends on its thread, unread", self._timeout_s
                )
            raise StructuredOutputError(
                f"the grammar did not compile within this server's limit of {self._timeout_s:g} s "
                "(engine.grammar_compile_timeout_s)"
            )
        return self._future.result()

    def cancel(self) -> bool:
        """The request went away: a compile not started yet never runs."""
        return self._future.cancel()
