"""Attacks on the Responses store under load (#47): the chaos 2 + 2 with its gateway's Responses store in
a redis-server started as ``pdserve serve --gateways N`` starts it (cluster/serve.py ``redis_server``:
loopback, a generated password in a private file, protected mode). Two attacks, each through the hostile
runner (tests/chaos/hostile.py ``run_attack``), so the load's answers must come back exact and nothing
may stay held meanwhile:

- a process at a worker's network position (any process of the host) reads the store without the
  password, and with a guessed one: refused (authentication required), the stored entry untouched;
- another API key reads, deletes, lists, cancels and continues a tenant's stored response: 404 with an
  OpenAI-style error body each time, the owner's copy untouched.

The tenant is the Bearer key's digest (gateway/dialects/responses/tenants.py), so the chaos load itself
sends no key and no gateway.api_keys list is configured."""

from __future__ import annotations

import subprocess
from urllib.parse import urlsplit

import httpx
import redis

from cluster.serve import redis_server, remove_redis_config
from gateway.dialects.responses.redis_store import KEY_PREFIX
from tests import hostile_attacks as attacks
from tests.chaos.hostile import HostileCluster, HostileResult
from tests.netns import poll_until


class StoreCluster(HostileCluster):
    """The hostile runner's cluster with its Responses store in a password-locked loopback Redis."""

    def __init__(self, model: str, tmp):
        self.redis_argv, self.redis_url = redis_server(max_mb=8)
        self.redis = subprocess.Popen(self.redis_argv, stdout=subprocess.DEVNULL)
        owner = redis.Redis.from_url(self.redis_url)
        if not poll_until(lambda: _answers(owner), 30):
            self._stop_redis()
            raise RuntimeError("redis-server did not come up")
        try:
            super().__init__(model, tmp, gateway={"responses_store_url": self.redis_url})
        except BaseException:
            self._stop_redis()
            raise

    def close(self, keep_logs: bool = False) -> None:
        try:
            super().close(keep_logs)
        finally:
            self._stop_redis()

    def _stop_redis(self) -> None:
        self.redis.terminate()
        self.redis.wait(10)
        remove_redis_config(self.redis_argv)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _store(cluster: StoreCluster, key: str, text: str) -> dict:
    response = httpx.post(
        f"{cluster.url}/v1/responses",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": cluster.model, "input": text, "max_output_tokens": 4, "temperature": 0.0},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()


def redis_read_from_worker(cluster: StoreCluster, t: attacks.Target, result: HostileResult) -> None:
    """Without the password, and with a guessed one, the store reads and writes nothing."""
    stored = _store(cluster, "tenant-a", "my secret plan")
    owner = redis.Redis.from_url(cluster.redis_url)
    keys = sorted(owner.keys(KEY_PREFIX + "*"))
    if not any(stored["id"].encode() in k for k in keys):
        result.failures.append(f"the stored response {stored['id']} is not in Redis: {keys}")
    snapshot = {k: owner.dump(k) for k in keys}
    parts = urlsplit(cluster.redis_url)
    for password in (None, "guess"):
        stranger = redis.Redis(host=parts.hostname, port=parts.port, password=password)
        for attempt in (lambda: stranger.keys("*"), lambda: stranger.get(keys[0] if keys else "x")):
            result.sent += 1
            try:
                attempt()
                result.failures.append(f"Redis answered a client with password {password!r}")
            except redis.AuthenticationError:
                result.refused["redis_auth"] += 1
        stranger.close()
    if {k: owner.dump(k) for k in keys} != snapshot:
        result.failures.append("the stored entries changed")
    owner.close()


def cross_tenant_response(cluster: StoreCluster, t: attacks.Target, result: HostileResult) -> None:
    """Another key gets 404 and an OpenAI-style error body for every route and a continuation."""
    mine = _store(cluster, "tenant-a", "my secret plan")
    rid, url = mine["id"], f"{cluster.url}/v1/responses"
    other = {"Authorization": "Bearer tenant-b"}
    calls = [
        ("GET", f"{url}/{rid}", None),
        ("GET", f"{url}/{rid}/input_items", None),
        ("POST", f"{url}/{rid}/cancel", None),
        ("DELETE", f"{url}/{rid}", None),
        ("POST", url, {"model": cluster.model, "input": "go on", "previous_response_id": rid, "max_output_tokens": 4}),
    ]
    for method, target, body in calls:
        response = httpx.request(method, target, headers=other, json=body, timeout=60)
        result.sent += 1
        error = (
            response.json().get("error")
            if response.headers.get("content-type", "").startswith("application/json")
            else None
        )
        openai_style = isinstance(error, dict) and rid in error.get("message", "") and error.get("type")
        if response.status_code != 404 or not openai_style:
            result.failures.append(
                f"{method} {target.removeprefix(cluster.url)}: {response.status_code} {response.text[:200]}"
            )
        else:
            result.refused["not_found"] += 1
    again = httpx.get(f"{url}/{rid}", headers={"Authorization": "Bearer tenant-a"}, timeout=60)
    if again.status_code != 200 or again.json() != mine:
        result.failures.append(f"the owner's response changed: {again.status_code} {again.text[:200]}")


STORE_ATTACKS = {
    "Redis read from a worker's position": redis_read_from_worker,
    "cross-tenant read of a stored response": cross_tenant_response,
}
