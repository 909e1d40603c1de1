"""The routes that read the Responses API's store (gateway/dialects/responses/store.py), as OpenAI's:

    GET    /v1/responses/{id}              the Response as it was answered
    DELETE /v1/responses/{id}              {"id", "object": "response", "deleted": true}
    GET    /v1/responses/{id}/input_items  its input items, a page at a time (after, limit 1-100, order)
    POST   /v1/responses/{id}/cancel       a background response: stopped if still running (stored cancelled),
                                           returned as it is; any other: a 400

Behind replicas sharing the store, a background response runs on the replica that took its POST; a
cancel (or DELETE) reaching another one is published to every replica, and the answer waits (up to
``CANCEL_WAIT_S``) until the store shows it ended.

An id the store does not hold, or another API key's, is a 404 that says why it may be gone (tenants.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.http.errors import APIError, bad_request

from .background import BackgroundResponses
from .store import MAX_INPUT_ITEMS_PAGE, ResponseStore, StoredResponse, input_items_page
from .tenants import TenantStore, tenant_of

DEFAULT_PAGE = 20  # OpenAI's default limit
CANCEL_WAIT_S = 10.0  # a cancel waits this long for another replica to stop the response
RUNNING = ("queued", "in_progress")


def response_routes(
    store: ResponseStore, background: BackgroundResponses, authorize: Callable[[Request], None]
) -> list[Route]:
    def stored(request: Request) -> StoredResponse:
        authorize(request)
        rid = request.path_params["response_id"]
        entry = TenantStore(store, tenant_of(request.headers.get("authorization"))).get(rid)  # another key's: 404
        if entry is None:
            why = (
                "it was not stored, was deleted, or was dropped for room (least recently used first)"
                if store.enabled
                else "this server stores no responses (gateway.responses_store_mb is 0)"
            )
            raise APIError(
                404, f"No response found with id {rid[:100]!r}: {why}", param="response_id", code="not_found"
            )
        return entry

    async def stop_background(entry: StoredResponse) -> StoredResponse:
        """Stops a background response wherever it runs; returns it as it ended (as it is, where another
        replica did not stop it in time)."""
        rid = entry.body["id"]
        if await background.cancel(rid):
            return store.get(rid) or entry  # it stored itself cancelled
        if not (store.is_shared and entry.body["status"] in RUNNING):
            return entry
        store.publish_cancel(rid)
        give_up = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < give_up:
            await asyncio.sleep(0.05)
            now = store.get(rid)
            if now is None or now.body["status"] not in RUNNING:
                return now or entry
        return entry

    async def response(request: Request):
        entry = stored(request)
        if request.method == "DELETE":
            if entry.body.get("background"):
                await stop_background(entry)  # a deleted response stops taking up a worker
            store.delete(entry.body["id"])
            return JSONResponse({"id": entry.body["id"], "object": "response", "deleted": True})
        return JSONResponse(entry.body)

    async def cancel(request: Request):
        entry = stored(request)
        rid = entry.body["id"]
        if not entry.body.get("background"):
            raise bad_request(
                f"Only background responses can be cancelled; {rid!r} was answered while "
                f"its request waited (status {entry.body['status']!r})",
                "response_id",
            )
        entry = await stop_background(entry)
        return JSONResponse(entry.body)  # cancelling one that ended returns it as it ended (idempotent)

    async def input_items(request: Request):
        entry = stored(request)
        query = request.query_params
        limit = query.get("limit", str(DEFAULT_PAGE))
        if not (limit.isdigit() and 1 <= int(limit) <= MAX_INPUT_ITEMS_PAGE):
            raise bad_request(f"limit must be an integer from 1 to {MAX_INPUT_ITEMS_PAGE}", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        page = input_items_page(entry.input_items, query.get("after"), int(limit), order)
        if page is None:
            raise bad_request(f"after names no input item of response {entry.body['id']!r}", "after")
        return JSONResponse(page)

    return [
        Route("/v1/responses/{response_id}", response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
    ]
