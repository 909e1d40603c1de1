"""A small hand-written OpenAPI description of the gateway's routes (served at /openapi.json)."""

from __future__ import annotations

from . import __version__

_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERROR = {"description": "OpenAI error object", "content": _JSON}


def _post(summary: str) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": _JSON},
                     "responses": {"200": {"description": "OK (text/event-stream when stream is true)",
                                           "content": _JSON},
                                   "400": _ERROR, "401": _ERROR, "404": _ERROR, "413": _ERROR, "503": _ERROR}}}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


def openapi_spec() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve gateway", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _post("Text completion (OpenAI compatible)"),
            "/v1/chat/completions": _post("Chat completion (OpenAI compatible)"),
            "/v1/models": _get("Served models"),
            "/v1/workers": _get("Registered prefill and decode workers"),
            "/tokenize": _post("Prompt or messages to token ids"),
            "/detokenize": _post("Token ids to text"),
            "/health": _get("Liveness"),
            "/ready": _get("Readiness: 200 once a worker can serve, else 503"),
            "/metrics": _get("Prometheus metrics"),
            "/version": _get("Gateway version"),
        },
    }
