"""API keys: only their sha256 digests are kept, and a presented key is compared in constant time."""

from __future__ import annotations

import hashlib
import hmac


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """An empty key set means authentication is off."""

    __slots__ = ("_digests",)

    def __init__(self, keys: list[str]) -> None:
        assert all(keys), "an API key must not be empty"
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check_header(self, authorization: str | None) -> bool:
        """True for ``Bearer <key>`` with a known key. Every digest is compared: no early exit to time."""
        if not self.enabled:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        return self.check_key(authorization[len("Bearer ") :].strip())

    def check_key(self, key: str | None) -> bool:
        """True for a known key given bare (Anthropic's clients send it so, in ``x-api-key``)."""
        if not self.enabled:
            return True
        if not key:
            return False
        presented = _digest(key)
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(presented, d)
        return ok
