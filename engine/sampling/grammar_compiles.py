"""Bounds on compiling requests' grammars: a deadline per compile, a few threads, a bounded cache.

xgrammar cannot stop a compile once started, and a 64 KB grammar against a large vocabulary may take
minutes. So a request waits for its compile only until its deadline (counted from its submission, once
the tokenizer is loaded: the first compile's one-time load is not the request's doing); past it, the
request is refused with the limit named, and the compile is left to end on its thread, unread. A
request aborted before its compile started cancels it. The cache of compiled grammars keeps the most
recently used under a byte budget: unbounded, each unique grammar a client sends stays in memory
(xgrammar's GHSA-389x-67px-mjg3; vLLM bounds it at 512 MB, VLLM_XGRAMMAR_CACHE_MB, as we do). The
cache is pdserve's own (CompiledCache), not xgrammar's: xgrammar's ``cache_limit_bytes`` is
approximate ("the actual memory usage may slightly exceed this value"), and 0.2.9 evicts only after
an insert has gone over it (a 128 KiB budget held 132,524 bytes), so the budget would not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    compile_timeout_s: float = 30.0  # engine.grammar_compile_timeout_s
    cache_bytes: int = 512 << 20  # engine.grammar_cache_mb: the LRU cache of compiled grammars; -1: unbounded
    num_threads: int = 2  # engine.grammar_compile_threads: compiles running at once

    def __post_init__(self) -> None:
        assert self.compile_timeout_s > 0 and self.num_threads >= 1, self


class CompiledCache:
    """Compiled grammars by their source, least recently used out so the bytes held never pass the
    budget. An entry's bytes are what xgrammar measures of the compiled grammar
    (``memory_size_bytes``: its token masks and rules) plus its source text, the key, as xgrammar's own
    cache counts it. Eviction comes before the insert, so the total is at most the budget at every
    moment; a grammar larger than the whole budget is served but not kept. Compiling threads share it."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes  # -1: unbounded
        self._entries: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()  # oldest use first
        self._size = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._size

    def get(self, key: tuple[str, str]):
        """The compiled grammar for ``key`` (now the most recently used), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key][0]

    def put(self, key: tuple[str, str], compiled) -> None:
        size = compiled.memory_size_bytes + sum(len(part.encode()) for part in key)
        with self._lock:
            if key in self._entries:  # two threads compiled the same grammar: keep one
                return
            if 0 <= self._budget < size:
                return
            while self._budget >= 0 and self._size + size > self._budget:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._size -= evicted
            self._entries[key] = (compiled, size)
            self._size += size


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
