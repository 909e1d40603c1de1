"""Routing policies and the disaggregation decision, with exact worker choices."""

from gateway.workers.registry import Role, WorkerRegistry
from gateway.workers.router import Policy, RouteDecision, Router, RouterParams
from protocol.serving import Heartbeat

BS = 4


def hb(wid, role=Role.DECODE, incarnation="a", in_use=0, queued=0, draining=False):
    return Heartbeat(
        wid,
        role.value,
        "tcp://x" if role is Role.DECODE else "tcp://y",
        incarnation,
        block_size=BS,
        kv_blocks_total=100,
        kv_blocks_free=100 - in_use,
        kv_blocks_in_use=in_use,
        num_running=0,
        num_waiting=0,
        queued_prefill_tokens=queued,
        draining=draining,
    )


def registry(decode_loads: dict, prefill_queued: dict | None = None, incarnation="a") -> WorkerRegistry:
    reg = WorkerRegistry()
    for wid, in_use in decode_loads.items():
        reg.observe(hb(wid, incarnation=incarnation, in_use=in_use), 0.0)
    for wid, queued in (prefill_queued or {}).items():
        reg.observe(hb(wid, Role.PREFILL, incarnation, queued=queued), 0.0)
    return reg


def test_round_robin_cycles_in_id_order():
    router = Router(registry({"d2": 0, "d1": 0, "d3": 0}), RouterParams(BS, Policy.ROUND_ROBIN))
    assert [router.route([1, 2, 3]).decode_worker for _ in range(4)] == ["d1", "d2", "d3", "d1"]


def test_least_loaded_picks_fewest_blocks_in_use():
    router = Router(registry({"d1": 50, "d2": 10, "d3": 30}), RouterParams(BS, Policy.LEAST_LOADED))
    assert router.route([1, 2, 3]).decode_worker == "d2"


def test_prefix_policy_follows_the_cached_prefix_over_load():
    reg = registry({"d1": 0, "d2": 0})
    router = Router(reg, RouterParams(BS, Policy.PREFIX, local_prefill_max_tokens=1000))
    prompt = list(range(10))  # two full blocks + a partial one
    first = router.route(prompt)
    assert first == RouteDecision("d1", None, 0, 0)  # tie on hits and load: lowest id
    reg.observe(hb("d1", in_use=60), 1.0)
    again = router.route(prompt[:8] + [99, 98, 97])  # shares the first two blocks
    assert again == RouteDecision("d1", None, 8, 0)  # the prefix hit beats d2's lower load
    other = router.route([50, 51, 52, 53, 54])
    assert other.decode_worker == "d2" and other.decode_cached_tokens == 0  # no hit anywhere: least loaded


def test_restart_forgets_the_prefix():
    reg = registry({"d1": 0, "d2": 0})
    router = Router(reg, RouterParams(BS, local_prefill_max_tokens=1000))
    router.route(list(range(8)))
    reg.observe(hb("d1", incarnation="b"), 1.0)
    assert router.route(list(range(8))).decode_cached_tokens == 0


def test_tracked_prefix_is_bounded_by_the_workers_pool():
    # d1 holds 100 blocks: once 100 newer blocks went there, the oldest prompt cannot still be cached.
    router = Router(registry({"d1": 0}), RouterParams(BS, local_prefill_max_tokens=1000))
    prompts = [[i * 9 + k for k in range(9)] for i in range(51)]  # 2 full blocks each: 102 hashes
    for prompt in prompts:
        router.route(prompt)
    assert router.route(prompts[1]).decode_cached_tokens == 2 * BS  # among the newest 100
    assert router.route(prompts[0]).decode_cached_tokens == 0  # forgotten, oldest first


def test_disaggregation_long_uncached_suffix_goes_to_prefill():
    reg = registry({"d1": 0}, {"p1": 500, "p2": 100})
    router = Router(reg, RouterParams(BS, local_prefill_max_tokens=8))
    short = router.route(list(range(8)))
    assert short.prefill_worker is None  # 8 uncached tokens and every P has more queued: local on D
    long_prompt = list(range(100, 140))
    decision = router.route(long_prompt)
    assert decision == RouteDecision("d1", "p2", 0, 0)  # fewest queued prefill tokens
    reg.observe(hb("p2", Role.PREFILL, queued=520), 1.0)
    follow_up = long_prompt + list(range(200, 240))
    decision = router.route(follow_up)
    # D has the first 40 tokens (10 blocks); 40 uncached > 8, so P. p2 holds those 40 too:
    # 520 queued + 40 to compute < p1's 500 + 80.
    assert decision == RouteDecision("d1", "p2", 40, 40)
    assert router.route(long_prompt).prefill_worker is None  # now fully cached on D: local
    reg.observe(hb("p2", Role.PREFILL, queued=560), 2.0)
    other_follow_up = long_prompt + list(range(300, 340))
    # p2: 560 + 40 = 600 > p1: 500 + 80 = 580. The hit no longer pays for the queue.
    assert router.route(other_follow_up) == RouteDecision("d1", "p1", 40, 0)


def test_short_suffix_goes_to_an_idle_prefill_worker_and_stays_on_d_while_every_p_is_busy():
    reg = registry({"d1": 0}, {"p1": 0, "p2": 300})
    router = Router(reg, RouterParams(BS, local_prefill_max_tokens=64))
    assert router.route(list(range(40))).prefill_worker == "p1"  # short, but p1 is idle: D keeps decoding
    assert router.route(list(range(100, 104))).prefill_worker is None  # one block: not worth the round trip
    # The gateway's own sends count at once, before any heartbeat shows them.
    router.prefill_sent("p1", 65)
    assert router.route(list(range(200, 240))).prefill_worker is None  # p1: 65 > 64 waiting; p2: 300
    router.prefill_done("p1", 65)  # its first token came back
    assert router.route(list(range(300, 340))).prefill_worker == "p1"
    reg.observe(hb("p1", Role.PREFILL, queued=500), 1.0)  # another gateway's work, seen in a heartbeat
    assert router.route(list(range(400, 440))).prefill_worker is None
    assert router.route(list(range(500, 600))).prefill_worker == "p2"  # long: to the smaller backlog
    router.forget(["p1"])
    assert router.backlog(reg.get("p2")) == 300


def test_a_rejoined_prefill_worker_gets_work_while_the_other_holds_every_prefix():
    # p1 dropped out (forgotten, then seen again): p2 served every prompt meanwhile and holds their hashes.
    reg = registry({"d1": 0}, {"p1": 0, "p2": 0})
    router = Router(reg, RouterParams(BS, local_prefill_max_tokens=0))
    prompts = [list(range(i * 100, i * 100 + 40)) for i in range(4)]
    router.forget(["p1"])
    for prompt in prompts:
        assert router.route(prompt, exclude=frozenset({"p1"})).prefill_worker == "p2"
    router.prefill_sent("p2", 120)  # three of them still queued there
    # Follow-ups: 40 tokens cached on D and on p2, 40 new. p2: 120 queued + 40; p1: 0 + 80.
    follow_ups = [p + list(range(5000 + 100 * i, 5040 + 100 * i)) for i, p in enumerate(prompts)]
    assert [router.route(f).prefill_worker for f in follow_ups[:3]] == ["p1", "p1", "p1"]
    router.prefill_done("p2", 120)
    # p2 idle again: its hit decides (p2: 0 + 40 < p1: 0 + 80).
    assert router.route(follow_ups[3]) == RouteDecision("d1", "p2", 40, 40)


def test_no_prefill_pool_means_local_prefill():
    router = Router(registry({"d1": 0}), RouterParams(BS, local_prefill_max_tokens=0))
    assert router.route(list(range(50))).prefill_worker is None


def test_kv_headroom_and_exclusions():
    reg = registry({"d1": 99, "d2": 97})  # d1 has 1 free block, d2 has 3
    router = Router(reg, RouterParams(BS, Policy.LEAST_LOADED))
    assert router.route(list(range(11))).decode_worker == "d2"  # 11 + 1 tokens need 3 blocks
    assert router.route(list(range(12))) is None  # 13 tokens need 4 blocks: nobody has room
    assert router.route([1], exclude=frozenset({"d2"})).decode_worker == "d1"
    assert router.route(list(range(11)), exclude=frozenset({"d2"})) is None


def test_draining_and_excluded_workers_get_nothing_new():
    reg = registry({"d1": 0, "d2": 50}, {"p1": 0, "p2": 10})
    router = Router(reg, RouterParams(BS, Policy.LEAST_LOADED, local_prefill_max_tokens=4))
    reg.observe(hb("d1", draining=True), 1.0)
    reg.observe(hb("p1", Role.PREFILL, draining=True), 1.0)
    assert router.route(list(range(20))) == RouteDecision("d2", "p2", 0, 0)
    assert router.route(list(range(100, 120)), exclude=frozenset({"p2"})) == RouteDecision("d2", None, 0, 0)
    assert router.route(list(range(200, 220)), exclude=frozenset({"d2"})) is None


def test_prompt_logprobs_count_no_prefix_hit_and_with_n_over_1_stay_on_decode():
    reg = registry({"d1": 0}, {"p1": 0})
    router = Router(reg, RouterParams(BS, local_prefill_max_tokens=16))
    prompt = list(range(40))
    assert router.route(prompt) == RouteDecision("d1", "p1", 0, 0)
    assert router.route(prompt) == RouteDecision("d1", None, 40, 0)  # cached on D now: nothing for P
    # Prompt logprobs: every token is computed whatever is cached, so the 40 tokens go to P again...
    assert router.route(prompt, whole_prompt=True) == RouteDecision("d1", "p1", 0, 0)
    # ...unless D computes the prompt itself (n > 1).
    assert router.route(prompt, whole_prompt=True, prefill_on_decode=True) == RouteDecision("d1", None, 0, 0)
