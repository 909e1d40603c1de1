"""The Responses API's store in Redis, shared by every gateway replica (``gateway.responses_store_url``).

The same interface as the in-memory ``ResponseStore`` (gateway/response_store.py), so a response
answered by one replica is read back (``GET /v1/responses/{id}``), listed, deleted or gone on from
(``previous_response_id``) on any other. One key per response, ``pdserve:response:<id>``, holding the
JSON of ``[body, input_items]``: a background response's status updates overwrite it in place.

Room: Redis holds the budget, not the gateway: give it ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` (``pdserve serve --gateways N`` and the deploy files start it so), and the least recently
used responses go first, as in memory. A response alone larger than ``gateway.responses_store_mb`` is
not kept, as in memory.

Cancelling a background response from another replica than the one running it: the cancel is
published on ``pdserve:cancel``; every replica listens (a thread here) and the one running it stops it
and stores it cancelled, which the asking replica waits for (gateway/response_routes.py).

A background response still running names the replica running it (stored beside it, not in the body),
and every listening replica keeps a key ``pdserve:replica:<id>`` alive (``LIVENESS_S``). One read
``queued`` or ``in_progress`` whose replica's key has expired died with that replica (its workers
aborted its request): it is stored ``failed`` then, with an error that says so.

Calls are synchronous: one loopback round trip (~0.1 ms) per store operation of a Responses request,
less than tokenizing it; a Redis that does not answer within ``TIMEOUT_S`` is a 503 that says so.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from gateway.http.errors import APIError

from .store import StoredResponse, conversation

log = logging.getLogger("pdserve.gateway")

KEY_PREFIX = "pdserve:response:"
REPLICA_PREFIX = "pdserve:replica:"
CANCEL_CHANNEL = "pdserve:cancel"
LIVENESS_S = 10.0  # a replica's key outlives its last refresh by this long (refreshed every third of it)
RUNNING = ("queued", "in_progress")
TIMEOUT_S = 2.0
MAX_CHAIN = 10_000  # turns of one conversation walked back at most


def _unavailable(e: redis.RedisError) -> APIError:
    return APIError(
        503, f"the response store (Redis) did not answer: {str(e)[:200]}", code="store_unavailable", retry_after_s=1
    )


class RedisResponseStore:
    is_shared = True

    def __init__(self, url: str, max_bytes: int) -> None:
        self.url = url
        self.max_bytes = max_bytes
        self.replica_id = uuid.uuid4().hex  # names this process beside the background responses it runs
        self._redis = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        try:
            return int(self._redis.dbsize())  # the database is the store's own (docs/gateway-replicas.md)
        except redis.RedisError:
            return 0  # a scrape must not fail on it; requests say why

    @property
    def num_bytes(self) -> int:
        try:
            return int(self._redis.info("memory").get("used_memory_dataset", 0))
        except redis.RedisError:
            return 0

    def put(self, body: dict, input_items: list[dict], owner: str = "") -> bool:
        """Keeps the response; False where it alone is larger than the budget (and its earlier state is
        dropped then, as in memory) or Redis did not take it (logged: the client has its answer)."""
        runner = self.replica_id if body.get("status") in RUNNING else None
        data = json.dumps([body, input_items, runner, owner], ensure_ascii=False)
        key = KEY_PREFIX + body["id"]
        try:
            if len(data) > self.max_bytes:
                self._redis.delete(key)
                return False
            self._redis.set(key, data.encode("utf-8"))
            return True
        except redis.RedisError as e:
            log.error("response %s not stored: %s", body["id"], e)
            return False

    def get(self, rid: str) -> StoredResponse | None:
        try:
            data = self._redis.get(KEY_PREFIX + rid)
        except redis.RedisError as e:
            raise _unavailable(e) from None
        if data is None:
            return None
        body, input_items, runner, *rest = json.loads(data)
        owner = rest[0] if rest else ""  # entries stored before owners were kept belong to no key
        if runner is not None and runner != self.replica_id and not self._is_alive(runner):
            body = {
                **body,
                "status": "failed",
                "error": {
                    "code": "server_error",
                    "message": "the gateway replica running this background response stopped before it ended",
                },
            }
            self.put(body, input_items, owner)
        return StoredResponse(body, input_items, len(data), owner)

    def _is_alive(self, replica_id: str) -> bool:
        try:
            return bool(self._redis.exists(REPLICA_PREFIX + replica_id))
        except redis.RedisError as e:
            raise _unavailable(e) from None

    def delete(self, rid: str) -> bool:
        try:
            return bool(self._redis.delete(KEY_PREFIX + rid))
        except redis.RedisError as e:
            raise _unavailable(e) from None

    def conversation(self, rid: str) -> list[dict] | str:
        return conversation(self.get, rid, MAX_CHAIN)

    # ---- background responses running on another replica ----
    def publish_cancel(self, rid: str) -> None:
        try:
            self._redis.publish(CANCEL_CHANNEL, rid)
        except redis.RedisError as e:
            raise _unavailable(e) from None

    def listen_for_cancels(self, on_cancel: Callable[[str], None]) -> Callable[[], None]:
        """Calls ``on_cancel(rid)`` (on a daemon thread) for every cancel any replica publishes, and keeps
        this replica's liveness key alive; returns the function that stops both. A lost connection is
        retried."""
        stop = threading.Event()

        def listen() -> None:
            refresh_at = 0.0
            while not stop.is_set():
                try:
                    pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(CANCEL_CHANNEL)
                    while not stop.is_set():
                        if time.monotonic() >= refresh_at:
                            self._redis.set(REPLICA_PREFIX + self.replica_id, b"1", ex=int(LIVENESS_S))
                            refresh_at = time.monotonic() + LIVENESS_S / 3
                        message = pubsub.get_message(timeout=0.5)
                        if message is not None and isinstance(message.get("data"), bytes):
                            on_cancel(message["data"].decode("utf-8", "replace")[:200])
                    pubsub.close()
                except redis.RedisError as e:
                    log.warning("listening for cancels on the response store: %s; retrying", e)
                    stop.wait(1.0)

        threading.Thread(target=listen, name="response-store-cancels", daemon=True).start()
        return stop.set
