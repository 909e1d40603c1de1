"""The LoRA adapters this server serves, by the name a request puts in ``model`` (as vLLM's
``--lora-modules name=path``). Workers load each adapter from its path (the same filesystem on every
host), at start-up from their config and at run time when the list changes (``/v1/load_lora_adapter``).

With workers behind a ZeroMQ backend the list is the cluster's, as the workers hold it
(``Backend.lora_adapters``, gateway/workers/lora_list.py): every gateway of ``pdserve serve --gateways N``
serves and lists the same adapters, whichever gateway loaded them. Without (tests' in-process
backends) it is this object's own.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.serving import MAX_LORA_NAME_CHARS

from ..http.errors import APIError, bad_request


class LoRAAdapters:
    def __init__(
        self,
        base_name: str,
        enabled: bool,
        modules: dict[str, str] | None = None,
        shared: Callable[[], dict[str, str] | None] | None = None,
    ) -> None:
        self.base_name = base_name
        self.enabled = enabled
        self._own: dict[str, str] = dict(modules or {})  # name -> adapter directory
        self._shared = shared  # the cluster's list (Backend.lora_adapters), when there is one

    @property
    def paths(self) -> dict[str, str]:
        shared = self._shared() if self._shared is not None else None
        return shared if shared is not None else self._own

    def resolve(self, model: str | None) -> str:
        """The adapter a request's ``model`` names: "" for the base (or no model); a 404 as vLLM's for
        a name that is neither."""
        if model is None or model == self.base_name:
            return ""
        if model in self.paths:
            return model
        served = ", ".join(f"`{n}`" for n in [self.base_name, *self.paths])
        raise APIError(
            404,
            f"The model `{model[:200]}` does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def check_new(self, name: object, path: object) -> None:
        """A 400 for a load request this server cannot take (before any worker is asked)."""
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server (start it with --enable-lora)")
        if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_CHARS:
            raise bad_request(
                f"lora_name must be a non-empty string of at most {MAX_LORA_NAME_CHARS} characters", "lora_name"
            )
        if not isinstance(path, str) or not path:
            raise bad_request(
                "lora_path must be a non-empty string (a directory on the workers' filesystem)", "lora_path"
            )
        if name == self.base_name or name in self.paths:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")

    def add(self, name: str, path: str) -> None:
        self._own[name] = path

    def remove(self, name: str) -> None:
        self._own.pop(name, None)

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        """``/v1/models`` entries of the adapters: each names the base as its ``parent`` (vLLM's)."""
        paths = self.paths
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pdserve",
                "root": path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for name, path in paths.items()
        ]
