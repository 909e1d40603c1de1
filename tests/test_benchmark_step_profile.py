"""The step profile's timer: each category gets only the time not spent in a category nested in it, so
the shares of a step add up to the step."""

from __future__ import annotations

from benchmarks.engine import step_profile
from benchmarks.engine.step_profile import ExclusiveTimer


def test_nested_categories_count_exclusive_time(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.5, 6.0, 10.0])  # the instants of the enters and leaves below
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: next(clock))
    timer = ExclusiveTimer()
    timer.enter("engine other")  # 0.0
    timer.enter("model glue")  # 1.0: 1 s of engine other so far
    timer.enter("layer linears")  # 3.0: 2 s of glue
    timer.leave()  # 3.5: 0.5 s of linears
    timer.leave()  # 6.0: 2.5 s more of glue
    timer.leave()  # 10.0: 4 s more of engine other
    assert timer.seconds["engine other"] == 5.0
    assert timer.seconds["model glue"] == 4.5
    assert timer.seconds["layer linears"] == 0.5
    assert sum(timer.seconds.values()) == 10.0  # the whole span, counted once


def test_instrumented_restores_what_it_wrapped():
    from engine.model.cpu_linear import Linear
    from engine.sampling.sampler import Sampler

    before = (Linear.forward, Sampler.__call__)
    with step_profile.instrumented(ExclusiveTimer()):
        assert Linear.forward is not before[0]
    assert (Linear.forward, Sampler.__call__) == before
