"""A prefix-cache salt per API key (``gateway.cache_salt_per_api_key``, #47).

vLLM's ``cache_salt`` lets a client keep its prefix KV apart; this makes the gateway do it for every
client by key: each request's salt becomes a digest of its API key (and of the salt it sent, if any),
so two keys never share a cached block, and one key cannot time another's cache hits to learn what
that tenant's prompts begin with. Requests of one key still share their prefixes. Off by default: a
cluster serving one tenant keeps one shared prefix cache, as vLLM's does.
"""

from __future__ import annotations

import hashlib

_LABEL = b"pdserve api key cache salt v1\0"


def api_key_of(headers) -> str:
    """The key a request presented: ``Authorization: Bearer`` or Anthropic's ``x-api-key`` ("" for none)."""
    authorization = headers.get("authorization") or ""
    if authorization.startswith("Bearer "):
        return authorization[len("Bearer ") :].strip()
    return headers.get("x-api-key") or ""


def salt_for_key(key: str, request_salt: str) -> str:
    """The salt a request's blocks are hashed under: its key's (64 hex characters) with its own inside."""
    digest = hashlib.sha256(_LABEL + key.encode("utf-8") + b"\0" + request_salt.encode("utf-8"))
    return digest.hexdigest()
