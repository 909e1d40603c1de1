"""Admin routes: runtime LoRA load and unload need an admin API key, off unless configured (#47).

vLLM serves ``/v1/load_lora_adapter`` only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set; pdserve's
equivalent is ``gateway.admin_api_keys``: empty (the default) turns the routes off, and otherwise only a
Bearer key from that list may change the adapter list. An ordinary API key cannot, so no tenant maps a
name to a directory of its choosing or learns from the load errors which paths exist on the workers.
"""

from __future__ import annotations

from starlette.requests import Request

from .auth import ApiKeys
from .errors import APIError

OFF = (
    "runtime LoRA adapter changes are off on this server: set gateway.admin_api_keys "
    "(as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) and call with one of those keys"
)
NOT_ADMIN = "changing LoRA adapters at run time needs an admin API key (gateway.admin_api_keys)"


class AdminGate:
    __slots__ = ("_keys",)

    def __init__(self, admin_keys: list[str]) -> None:
        self._keys = ApiKeys(admin_keys)

    def authorize(self, request: Request, authorize_api_key) -> None:
        """Passes an admin key; otherwise the route's ordinary check (a stranger stays a 401), then 403."""
        authorization = request.headers.get("authorization")
        if self._keys.enabled and self._keys.check_header(authorization):
            return
        authorize_api_key(request)
        raise APIError(403, NOT_ADMIN if self._keys.enabled else OFF, code="permission_denied")
