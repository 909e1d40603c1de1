"""A worker's step budget (worker/step_pacer.py): a step ends within a heartbeat interval at the measured
rate, never above the configured budget nor under the floor, and a step of a few decode rows does not
lower the rate."""

from __future__ import annotations

from worker.step_pacer import StepPacer


def test_first_step_is_one_chunk_then_the_budget_follows_the_rate():
    pacer = StepPacer(configured=2048, target_s=5.0, first=512)
    assert pacer.budget() == 512
    pacer.record(512, 4.0)  # 128 tokens/s: 640 tokens in 5 s
    assert pacer.budget() == 640
    pacer.record(640, 10.0)  # slower now (64/s): the average halves the way, 96/s
    assert pacer.budget() == 480


def test_a_fast_machine_keeps_the_configured_budget_and_a_slow_one_the_floor():
    fast = StepPacer(configured=2048, target_s=5.0, first=512)
    fast.budget()
    fast.record(512, 0.25)  # 2048 tokens/s
    assert fast.budget() == 2048
    slow = StepPacer(configured=2048, target_s=5.0, first=512, floor=64)
    slow.budget()
    slow.record(512, 512.0)  # 1 token/s
    assert slow.budget() == 64
    small = StepPacer(configured=32, target_s=5.0, first=512)
    assert small.budget() == 32  # never above the configuration, even the first step


def test_steps_far_under_budget_do_not_move_the_rate():
    pacer = StepPacer(configured=2048, target_s=5.0, first=512)
    pacer.budget()
    pacer.record(512, 2.0)  # 256/s
    assert pacer.budget() == 1280
    pacer.record(16, 1.0)  # 16 decode rows: per-step overhead, not the rate
    assert pacer.tokens_per_s == 256.0 and pacer.budget() == 1280
    pacer.record(0, 0.0)
    assert pacer.budget() == 1280
