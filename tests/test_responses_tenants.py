"""Stored responses belong to the API key that made them (gateway/dialects/responses/tenants.py): another
key reads, lists, cancels, deletes and continues from none of them (a 404 like an id never stored), and
the owner's copy is untouched afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.dialects.responses.store import ResponseStore
from gateway.dialects.responses.tenants import TenantStore, tenant_of
from tests.fake_backend import API_KEYS, MODEL
from tests.test_gateway_responses_api import live, tok_dir  # noqa: F401  (fixtures)


def test_another_api_key_gets_404_for_every_route_and_continuation(client, live, backend):  # noqa: F811
    mine = client.responses.create(model=MODEL, input="my secret plan")
    other = openai.OpenAI(base_url=live.base_url + "/v1", api_key=API_KEYS[1], max_retries=0)
    for call in (other.responses.retrieve, other.responses.delete, other.responses.input_items.list):
        with pytest.raises(openai.NotFoundError, match="No response found with id"):
            call(mine.id)
    cancel = httpx.post(
        f"{live.base_url}/v1/responses/{mine.id}/cancel", headers={"Authorization": f"Bearer {API_KEYS[1]}"}
    )
    assert cancel.status_code == 404
    received = len(backend.received)
    with pytest.raises(openai.NotFoundError, match="Previous response with id"):
        other.responses.create(model=MODEL, input="go on", previous_response_id=mine.id)
    assert len(backend.received) == received  # nothing of the owner's conversation reached a worker
    assert client.responses.retrieve(mine.id).model_dump() == mine.model_dump()  # the owner's is intact


def test_a_tenant_view_sees_only_its_own_chain():
    store = ResponseStore(1 << 20)
    a, b = TenantStore(store, tenant_of("Bearer key-a")), TenantStore(store, tenant_of("Bearer key-b"))
    assert a.owner != b.owner and "key-a" not in a.owner  # a digest, never the key
    a.put({"id": "resp_1", "output": [{"t": 1}], "previous_response_id": None}, [{"t": 0}])
    b.put({"id": "resp_2", "output": [{"t": 3}], "previous_response_id": "resp_1"}, [{"t": 2}])
    assert b.get("resp_1") is None and b.conversation("resp_2") == "resp_1"  # b cannot chain onto a's
    assert a.conversation("resp_1") == [{"t": 0}, {"t": 1}]
    assert not b.delete("resp_1") and a.get("resp_1") is not None
    assert TenantStore(store, tenant_of(None)).get("resp_1") is None
