"""Bounds on structured-output compiles (engine/sampling/grammar_compiles.py): a deadline per compile, cancel on
abort, a bounded cache of compiled grammars. A compile is held back by the test (the compiler's load
lock), so the deadline is crossed for certain, not by a race with a fast compile."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine.sampling.grammar_compiles import CompiledCache, GrammarLimits
from engine.sampling.structured_output import Grammars, StructuredOutputError
from protocol.serving import StructuredOutput
from tests.model_factory import tiny_model_dir

VOCAB = 768  # the tiny models' vocabulary


def grammars(**limits) -> Grammars:
    g = Grammars(tiny_model_dir("llama"), VOCAB, [2], GrammarLimits(**limits))
    g.guide(StructuredOutput("regex", "[0-9]"))  # the tokenizer loads now: deadlines count from here
    return g


def wait_done(ticket, timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not ticket.done():
        assert time.monotonic() < give_up, "compile ticket never done"
        time.sleep(0.01)


def test_a_compile_past_its_deadline_is_refused_naming_the_limit():
    g = grammars(compile_timeout_s=0.2, num_threads=1)
    with g._loading:  # the compile waits on this lock: it cannot end before the deadline
        ticket = g.guide_async(StructuredOutput("regex", "[a-z]+"))
        wait_done(ticket)
        with pytest.raises(
            StructuredOutputError,
            match=r"^the grammar did not compile within this server's limit "
            r"of 0\.2 s \(engine\.grammar_compile_timeout_s\)$",
        ):
            ticket.result()
    later = g.guide_async(StructuredOutput("regex", "[a-z]+"))  # the thread is free again: served
    wait_done(later)
    assert later.result() is not None


def test_an_aborted_request_cancels_its_compile_before_it_runs():
    g = grammars(compile_timeout_s=60.0, num_threads=1)
    with g._loading:
        running = g.guide_async(StructuredOutput("regex", "[a-z]+"))  # takes the one thread, held
        queued = g.guide_async(StructuredOutput("regex", "[0-9]+x"))
        assert queued.cancel()
    wait_done(running)
    assert running.result() is not None
    assert queued._future.cancelled()


def distinct_regexes(count: int) -> list[StructuredOutput]:
    return [StructuredOutput("regex", f"(item{i}-[a-z]{{{i % 7 + 1}}}[0-9]+,)+" + "x" * (i % 13)) for i in range(count)]


def test_the_compiled_grammar_cache_stays_under_its_budget():
    budget = 128 << 10
    g = grammars(cache_bytes=budget)
    sizes = []
    for spec in distinct_regexes(60):  # each a cache entry of a few KB
        g.guide(spec)
        sizes.append(g.cache_size_bytes)
    assert max(sizes) <= budget and sizes[-1] > budget // 2


def test_an_unbounded_cache_would_have_grown_past_that_budget():
    """The check above means something: without the bound the same grammars take far more."""
    g = grammars(cache_bytes=-1)
    for spec in distinct_regexes(60):
        g.guide(spec)
    assert g.cache_size_bytes > 4 * (128 << 10)


def test_the_cache_evicts_the_least_recently_used_before_an_insert_would_pass_the_budget():
    """CompiledCache alone, on entries of known size: xgrammar's measure of each grammar plus its key's
    bytes (2 here), the oldest use out first, never over the budget, an entry above it not kept."""
    cache = CompiledCache(budget_bytes=100)
    a, b, c, huge = (SimpleNamespace(memory_size_bytes=n) for n in (38, 38, 38, 99))
    cache.put(("r", "a"), a)
    cache.put(("r", "b"), b)
    assert cache.size_bytes == 80
    assert cache.get(("r", "a")) is a  # a is now the most recently used: b goes first
    cache.put(("r", "c"), c)
    assert [cache.get(("r", k)) for k in "abc"] == [a, None, c] and cache.size_bytes == 80
    cache.put(("r", "h"), huge)  # 101 bytes: served, never kept
    assert cache.get(("r", "h")) is None and cache.size_bytes == 80
