"""gateway/dialects/responses/redis_store.py against a real redis-server: what one replica stores, another reads,
lists and goes on from, as the in-memory store does; a cancel published by one replica reaches the
others; a Redis that does not answer is a 503 that says so."""

from __future__ import annotations

import threading

import pytest

from gateway.dialects.responses.redis_store import RedisResponseStore
from gateway.dialects.responses.store import ResponseStore
from gateway.http.errors import APIError


def response(rid: str, previous: str | None, text: str) -> dict:
    return {
        "id": rid,
        "object": "response",
        "status": "completed",
        "previous_response_id": previous,
        "output": [{"type": "message", "id": f"msg_{rid}", "content": [{"type": "output_text", "text": text}]}],
    }


def items(text: str) -> list[dict]:
    return [{"type": "message", "id": f"in_{text}", "role": "user", "content": [{"type": "input_text", "text": text}]}]


@pytest.mark.parametrize("shared", [True, False])
def test_two_replicas_see_one_conversation_as_one_memory_store_does(redis_url, shared):
    if shared:
        a, b = RedisResponseStore(redis_url, 1 << 20), RedisResponseStore(redis_url, 1 << 20)
        a._redis.flushdb()
    else:
        a = b = ResponseStore(1 << 20)  # the reference: one process's store
    assert a.put(response("resp_1", None, "Foxes."), items("foxes?"))
    assert b.put(response("resp_2", "resp_1", "Wolves."), items("wolves?"))
    assert a.get("resp_2").body == response("resp_2", "resp_1", "Wolves.")
    assert [i["id"] for i in a.conversation("resp_2")] == ["in_foxes?", "msg_resp_1", "in_wolves?", "msg_resp_2"]
    assert len(a) == len(b) == 2
    assert b.delete("resp_1") and not b.delete("resp_1")
    assert a.conversation("resp_2") == "resp_1"  # the chain's missing response, by id
    # a response alone larger than the budget is not kept, nor its earlier state
    small = RedisResponseStore(redis_url, 400) if shared else ResponseStore(400)
    assert small.put(response("resp_3", None, "x"), []) and not small.put(response("resp_3", None, "x" * 500), [])
    assert small.get("resp_3") is None


def test_a_cancel_published_by_one_replica_reaches_the_others(redis_url):
    a, b = RedisResponseStore(redis_url, 1 << 20), RedisResponseStore(redis_url, 1 << 20)
    heard, arrived = [], threading.Event()
    stop = a.listen_for_cancels(lambda rid: (heard.append(rid), arrived.set()))
    try:
        for _ in range(100):  # the subscription is made on the listener's thread: publish until it hears
            b.publish_cancel("resp_9")
            if arrived.wait(0.1):
                break
        assert heard and set(heard) == {"resp_9"}
    finally:
        stop()


def test_a_redis_that_does_not_answer_is_a_503_naming_the_store():
    store = RedisResponseStore("redis://127.0.0.1:1/0", 1 << 20)  # nothing listens on port 1
    with pytest.raises(APIError) as info:
        store.get("resp_1")
    assert info.value.status == 503 and "Redis" in info.value.message and info.value.retry_after_s == 1
    assert not store.put(response("resp_1", None, "x"), [])  # the answer went out; it is just not kept
    assert len(store) == 0 and store.num_bytes == 0  # a scrape still answers


def test_a_background_response_whose_replica_is_gone_reads_failed(redis_url):
    alive, reader, gone = (RedisResponseStore(redis_url, 1 << 20) for _ in range(3))
    stop = alive.listen_for_cancels(lambda rid: None)  # a serving replica keeps its liveness key
    try:
        for _ in range(100):
            if alive._is_alive(alive.replica_id):
                break
            threading.Event().wait(0.05)
        running = {**response("resp_a", None, ""), "status": "in_progress", "background": True}
        assert alive.put(running, items("count"))
        assert gone.put({**running, "id": "resp_g"}, items("count"))  # a replica that never served: dead
        assert reader.get("resp_a").body == running
        failed = reader.get("resp_g").body
        assert failed["status"] == "failed" and "stopped before it ended" in failed["error"]["message"]
        assert alive.get("resp_g").body == failed  # stored so, for every replica
        assert gone.put({**running, "id": "resp_d", "status": "completed"}, [])  # ended: no replica needed
        assert reader.get("resp_d").body["status"] == "completed"
    finally:
        stop()
