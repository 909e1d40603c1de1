"""The Responses API's store: answers kept in this gateway's memory, so that a later request can go on
from one (``previous_response_id``) and a client can read one back, list its input items or delete it.

OpenAI stores a response unless the request says ``store: false``, and so does the gateway, within a
memory budget (``gateway.responses_store_mb``; 0 turns the store off, and a response then says
``store: false``, as vLLM's do without its store). Past the budget the least recently used go first;
reading a response, or going on from it, uses every response of its chain.

A response keeps its own input items and its output, and names the one it went on from; a continuation
walks those links back, so a conversation of n turns is held once, not n times. This store is one gateway
process's; behind several replicas, ``gateway.responses_store_url`` names a Redis that all of them share
(gateway/dialects/responses/redis_store.py, the same interface), so any replica goes on from any response.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_INPUT_ITEMS_PAGE = 100  # OpenAI's limit on one page of input items


@dataclass(slots=True, frozen=True)
class StoredResponse:
    body: dict  # the Response object as its client got it (its previous_response_id links the chain)
    input_items: list[dict]  # the request's own input, as items with ids; instructions are not items
    size: int  # bytes it counts for against the budget: its JSON's length
    owner: str = ""  # digest of the API key that made it (tenants.py); "" with API keys off


class ResponseStore:
    is_shared = False  # other gateways see nothing kept here

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, body: dict, input_items: list[dict], owner: str = "") -> bool:
        """Keeps the response, evicting the least recently used to make room. False where it alone is
        larger than the whole budget: it is not kept, nor is an earlier state of it (a background
        response's in_progress must not stand for an answer that did not fit)."""
        self.delete(body["id"])
        size = len(json.dumps([body, input_items], ensure_ascii=False))
        if size > self.max_bytes:
            return False
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        self._entries[body["id"]] = StoredResponse(body, input_items, size, owner)
        self._bytes += size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None

    def conversation(self, rid: str) -> list[dict] | str:
        return conversation(self.get, rid, len(self._entries))


def conversation(get: Callable[[str], StoredResponse | None], rid: str, max_chain: int) -> list[dict] | str:
    """The items a response going on from ``rid`` starts with: every input and output item of its chain
    (read with ``get``), oldest first. Where a response of the chain is not held (never stored, deleted
    or evicted), its id instead."""
    chain: list[StoredResponse] = []
    wanted: str | None = rid
    while wanted is not None and len(chain) <= max_chain:  # ids are new: a chain has no loop
        entry = get(wanted)
        if entry is None:
            return wanted
        chain.append(entry)
        wanted = entry.body.get("previous_response_id")
    return [item for entry in reversed(chain) for item in entry.input_items + entry.body["output"]]


def input_items_page(items: list[dict], after: str | None, limit: int, order: str) -> dict | None:
    """One page of a response's input ``items``, as OpenAI lists them (``order`` "asc" or "desc", the
    items after the one whose id is ``after``). None where ``after`` names none of its items."""
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
