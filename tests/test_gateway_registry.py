"""Worker registry: join on heartbeat, restart on a new incarnation, leave after missed heartbeats."""

from gateway.workers.registry import Role, WorkerRegistry
from protocol.serving import Heartbeat


def hb(worker_id, role=Role.DECODE, incarnation="a", in_use=0, draining=False, steps=0, step_running_s=0.0):
    return Heartbeat(
        worker_id,
        role.value,
        f"tcp://127.0.0.1:{7000 + len(worker_id)}",
        incarnation,
        block_size=4,
        kv_blocks_total=100,
        kv_blocks_free=100 - in_use,
        kv_blocks_in_use=in_use,
        num_running=0,
        num_waiting=0,
        queued_prefill_tokens=0,
        draining=draining,
        steps_completed=steps,
        step_running_s=step_running_s,
    )


def test_join_update_and_roles():
    reg = WorkerRegistry(heartbeat_interval_s=1.0, max_missed=3)
    assert reg.observe(hb("d1"), now=0.0) is True
    assert reg.observe(hb("p1", Role.PREFILL), now=0.0) is True
    assert reg.observe(hb("d1", in_use=40), now=0.5) is False  # same incarnation: just a load update
    assert [w.worker_id for w in reg.workers(Role.DECODE)] == ["d1"]
    assert [w.worker_id for w in reg.workers(Role.PREFILL)] == ["p1"]
    assert reg.get("d1").kv_blocks_free == 60 and reg.get("d1").kv_usage == 0.4
    assert reg.get("d1").as_json()["load"]["kv_blocks_in_use"] == 40


def test_draining_workers_are_listed_but_not_accepting():
    reg = WorkerRegistry()
    reg.observe(hb("d1"), now=0.0)
    reg.observe(hb("d2", draining=True), now=0.0)
    assert [w.worker_id for w in reg.workers(Role.DECODE)] == ["d1", "d2"]
    assert [w.worker_id for w in reg.accepting(Role.DECODE)] == ["d1"]


def test_restart_is_reported_by_a_new_incarnation():
    reg = WorkerRegistry()
    reg.observe(hb("d1", incarnation="a"), now=0.0)
    assert reg.observe(hb("d1", incarnation="b"), now=1.0) is True
    assert reg.get("d1").incarnation == "b"


def test_drop_after_missed_heartbeats_exactly_at_the_timeout():
    reg = WorkerRegistry(heartbeat_interval_s=1.0, max_missed=3)
    reg.observe(hb("d1"), now=0.0)
    reg.observe(hb("d2"), now=2.0)
    assert reg.expire(now=3.0) == []  # d1 silent for exactly 3 s: still alive
    assert reg.expire(now=3.01) == ["d1"]
    assert [w.worker_id for w in reg.workers()] == ["d2"]
    reg.observe(hb("d1"), now=4.0)  # comes back: joins again
    assert [w.worker_id for w in reg.workers()] == ["d1", "d2"]
    assert reg.remove("d2") is True and reg.remove("d2") is False
    assert [w.worker_id for w in reg.workers()] == ["d1"]


def test_a_long_step_keeps_the_worker_a_step_past_the_deadline_makes_it_stuck_until_it_ends():
    reg = WorkerRegistry(heartbeat_interval_s=1.0, max_missed=3, step_timeout_s=10.0)
    reg.observe(hb("d1", steps=5), now=0.0)
    reg.observe(hb("d2", steps=7), now=0.0)
    # d1's heartbeats keep coming from its liveness thread while one step runs: never silent, never expired
    for t in range(1, 10):
        reg.observe(hb("d1", steps=6, step_running_s=float(t)), now=float(t))
        reg.observe(hb("d2", steps=7 + t), now=float(t))
        assert reg.expire(now=float(t)) == [] and reg.check_stuck(now=float(t)) == ([], [])
    assert reg.get("d1").step_age(9.5) == 9.5
    assert reg.check_stuck(now=10.0) == ([], [])  # exactly the deadline: still busy, not stuck
    assert reg.check_stuck(now=10.01) == (["d1"], [])  # 9 s reported at t=9, plus 1.01 s since
    assert reg.get("d1").is_stuck and reg.get("d1").as_json()["stuck"] is True
    assert [w.worker_id for w in reg.accepting(Role.DECODE)] == ["d2"]
    assert [w.worker_id for w in reg.workers(Role.DECODE)] == ["d1", "d2"]  # listed: it still heartbeats
    reg.observe(hb("d1", steps=6, step_running_s=11.0), now=11.0)
    assert reg.check_stuck(now=11.0) == ([], [])  # still stuck: reported once
    reg.observe(hb("d1", steps=7), now=12.0)  # the step ended
    assert reg.check_stuck(now=12.0) == ([], ["d1"])
    assert [w.worker_id for w in reg.accepting(Role.DECODE)] == ["d1", "d2"]


def test_a_stuck_worker_that_restarts_is_a_new_worker_and_zero_timeout_never_flags():
    reg = WorkerRegistry(heartbeat_interval_s=1.0, max_missed=3, step_timeout_s=2.0)
    reg.observe(hb("d1", step_running_s=5.0), now=0.0)
    assert reg.check_stuck(now=0.0) == (["d1"], [])
    reg.observe(hb("d1", incarnation="b"), now=1.0)  # a new process: not stuck, nothing to recover
    assert not reg.get("d1").is_stuck and reg.check_stuck(now=1.0) == ([], [])
    never = WorkerRegistry(heartbeat_interval_s=1.0, max_missed=3, step_timeout_s=0.0)
    never.observe(hb("d1", step_running_s=1e6), now=0.0)
    assert never.check_stuck(now=10.0) == ([], []) and [w.worker_id for w in never.accepting(Role.DECODE)] == ["d1"]
