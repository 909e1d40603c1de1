"""Attacks by a compromised member of one role on a real ``pdserve serve`` cluster whose members hold
their own credentials (#47: a key per role and per worker, protocol/role_keys.py; what `pdserve serve`
makes when no key is configured). The attacker holds what a compromised decode pod holds: decode-0's key
file and roles.pub, or a second decode member's key. Each attack is refused and counted; afterwards the
workers are the same processes (save the one the squatting test restarts), serve a fresh prompt exactly
as the single engine does, and hold no KV block nor more file descriptors than before.

Attacks elsewhere in CI: a cross-tenant read of a stored response (tests/test_responses_tenants.py), a
Redis read without the password from a worker's position (tests/test_redis_locked.py)."""

from __future__ import annotations

import signal

import httpx
import pytest
import zmq

from engine.sampling.params import SamplingParams
from protocol.codec import encode
from protocol.serving import Goodbye
from tests import hostile
from tests import hostile_roles as roles
from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir
from tests.test_hostile_peers import (  # noqa: F401  (reference, ledger: fixtures)
    BLOCK,
    Victims,
    complete,
    endpoints,
    expected,
    frozen_prefill_job,
    ledger,
    prompt_of,
    reference,
    rejected,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("hostile-roles"),
        engine={"block_size": BLOCK, "kv_cache_memory_mb": 8},
        gateway={"local_prefill_max_tokens": 0},  # every prompt goes through a prefill worker
    )
    yield serve
    for worker in ("prefill-0", "decode-0"):
        serve.signal(worker, signal.SIGCONT)
    assert serve.stop() == 0, "".join(serve.log[-30:])


@pytest.fixture
def victims(cluster, reference, ledger, request) -> Victims:  # noqa: F811
    return Victims(cluster, reference, ledger, request.node.name.removeprefix("test_").replace("_", " "))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def decode_key(cluster) -> str:
    return roles.member_key_file(cluster.worker_pid["decode-0"])


def test_a_decode_credential_cannot_pose_as_a_prefill_worker(cluster, victims, reference, ctx):  # noqa: F811
    """It signs a prefill registration with its own key: refused, so the wrong KV it would commit under a
    valid first token is never asked for; the same prompt from another client is exact twice over."""
    prompt = prompt_of(3 * BLOCK + 9, seed=6)
    first_token = reference.generate([prompt], hostile_sampling())[0].outputs[0].token_ids[0]
    before = rejected(cluster, "bad_proof")
    fake = hostile.FakePrefill(
        ctx, endpoints(cluster)["gateway"], roles.posing_as(decode_key(cluster), "prefill"), BLOCK, first_token
    )
    try:
        cluster.wait_until(lambda: rejected(cluster, "bad_proof") > before, "the posing registration refused")
        assert not cluster.registered("a-fake-prefill")
        assert complete(cluster, prompt) == expected(reference, prompt)
        assert complete(cluster, prompt) == expected(reference, prompt)  # nothing of it in any prefix cache
        assert fake.events == []  # never given a job
    finally:
        fake.close()
    victims.attacks += 1
    victims.assert_unharmed(seed=11)


def hostile_sampling() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_a_lora_list_stamped_in_a_heartbeat_is_not_adopted(cluster, victims, ctx):
    seen = len(cluster.log)
    stamper = roles.another_member(decode_key(cluster), "decode")
    sock = roles.stamped_lora_list(ctx, endpoints(cluster)["gateway"], stamper, "lora-stamper")
    try:
        cluster.wait_until(
            lambda: any("reports a LoRA list no gateway signed" in line for line in cluster.log[seen:]),
            "the stamped list ignored",
        )
        models = {m["id"] for m in httpx.get(f"{cluster.url}/v1/models").json()["data"]}
        assert "sql-assistant" not in models
    finally:
        sock.send(encode(Goodbye("lora-stamper")))
        sock.close(linger=1000)
    cluster.wait_until(lambda: not cluster.registered("lora-stamper"), "the stamper left the pool")
    victims.attacks += 1
    victims.assert_unharmed(seed=12)


def test_a_foreign_abort_of_a_prefill_job_is_refused(cluster, victims, reference, ctx):  # noqa: F811
    """Another decode member's AbortRequest for decode-0's job reaches prefill-0: refused (not_assigned)."""
    intruder = roles.another_member(decode_key(cluster), "decode")
    prompt = prompt_of(3 * BLOCK + 7, seed=13)
    before = rejected(cluster, "not_assigned", "prefill-0")
    try:
        client, result, rid, _ = frozen_prefill_job(cluster, prompt)
        roles.foreign_abort(ctx, endpoints(cluster)["prefill"], intruder, rid)
    finally:
        cluster.signal("prefill-0", signal.SIGCONT)
    cluster.wait_until(lambda: rejected(cluster, "not_assigned", "prefill-0") > before, "the foreign abort refused")
    client.join(timeout=120)
    assert result == [expected(reference, prompt)]
    victims.attacks += 1
    victims.assert_unharmed(seed=14)


def test_a_routing_id_cannot_be_squatted_across_a_restart(cluster, reference, ledger, ctx):  # noqa: F811
    """decode-0 is killed; while it restarts another decode member registers as decode-0: refused
    (identity_taken) — the id stays decode-0's member key's, and the restarted decode-0 takes it back."""
    intruder = roles.another_member(decode_key(cluster), "decode")
    old = cluster.registered("decode-0")
    before = rejected(cluster, "identity_taken")
    cluster.signal("decode-0", signal.SIGKILL)
    sock = roles.squat(ctx, endpoints(cluster)["gateway"], intruder, "decode-0")
    try:
        cluster.wait_until(lambda: rejected(cluster, "identity_taken") > before, "the squat refused")
        cluster.wait_restarted("decode-0", old["incarnation"], timeout_s=120)
        assert cluster.registered("decode-0")["address"] != "tcp://127.0.0.1:9"
    finally:
        sock.close(linger=0)
    victims = Victims(cluster, reference, ledger, "routing id squatting across a restart")
    victims.attacks += 1
    victims.assert_unharmed(seed=15)
