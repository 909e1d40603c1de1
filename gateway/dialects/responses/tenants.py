"""Stored responses belong to the API key that made them: a tenant's view of the store (#47).

Each stored response carries its owner, a digest of the API key that created it (``tenant_of``; never
the key). A tenant's view reads, continues from (``previous_response_id``), cancels and deletes only
its own: another key's id is a 404 exactly like an id never stored, so ids cannot be probed across
tenants. With API keys off every caller is one tenant (""), as before.
"""

from __future__ import annotations

import hashlib

from .store import ResponseStore, StoredResponse, conversation

_TENANT_LABEL = b"pdserve responses tenant v1\0"
MAX_CHAIN = 10_000  # a continuation walks at most this many responses back (ids are new: no loops)


def tenant_of(authorization: str | None) -> str:
    """The owner a request's stored responses get: a digest of its Bearer key ("" without one)."""
    if not authorization or not authorization.startswith("Bearer "):
        return ""
    key = authorization[len("Bearer ") :].strip()
    return hashlib.sha256(_TENANT_LABEL + key.encode("utf-8")).hexdigest()[:32]


class TenantStore:
    """The store as one tenant sees it; the same interface the pipeline and routes use."""

    __slots__ = ("_store", "owner")

    def __init__(self, store: ResponseStore, owner: str) -> None:
        self._store, self.owner = store, owner

    @property
    def enabled(self) -> bool:
        return self._store.enabled

    @property
    def is_shared(self) -> bool:
        return self._store.is_shared

    def put(self, body: dict, input_items: list[dict]) -> bool:
        return self._store.put(body, input_items, self.owner)

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._store.get(rid)
        return entry if entry is not None and entry.owner == self.owner else None

    def delete(self, rid: str) -> bool:
        return self.get(rid) is not None and self._store.delete(rid)

    def conversation(self, rid: str) -> list[dict] | str:
        return conversation(self.get, rid, MAX_CHAIN)

    def publish_cancel(self, rid: str) -> None:
        if self.get(rid) is not None:
            self._store.publish_cancel(rid)
