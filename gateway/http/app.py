"""The gateway's Starlette app, built from one ``GatewayParams``.

Open routes: /health, /ready, /metrics, /version, /openapi.json. Everything else needs an API key when
keys are configured. Every error leaves as OpenAI error JSON; nothing leaks a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from configs.schema import GatewayConfig
from gateway import __version__
from gateway.dialects.anthropic.dialect import MESSAGES
from gateway.dialects.openai.chat_prompt import parse_chat_prompt
from gateway.dialects.openai.dialect import CHAT, COMPLETIONS
from gateway.dialects.responses.dialect import RESPONSES
from gateway.dialects.responses.routes import response_routes
from gateway.dialects.responses.store import ResponseStore
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.serving.dialect import Dialect
from gateway.serving.lora_adapters import LoRAAdapters
from gateway.serving.pipeline import Serving, ServingLimits
from gateway.text.chat_output import ChatParsers
from gateway.text.tokenizer import Tokenizer
from gateway.text.tool_calls import parse_tools
from gateway.workers.backend import Backend
from gateway.workers.registry import WorkerRegistry
from telemetry.tracing import NO_TRACING, Tracer

from .admin import AdminGate
from .auth import ApiKeys
from .errors import APIError, bad_request
from .openapi import openapi_spec
from .request_fields import Fields
from .request_id import RequestIdEcho

log = logging.getLogger("pdserve.gateway")

DIALECTS = (COMPLETIONS, CHAT, RESPONSES, MESSAGES)  # every generation route, one per API dialect


@dataclass(slots=True)
class GatewayParams:
    tokenizer: Tokenizer
    backend: Backend
    limits: ServingLimits  # model name, context length, admission limit, Retry-After
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    admin_api_keys: list[str] = field(default_factory=list)  # runtime LoRA load/unload; empty: off (admin.py)
    max_body_bytes: int = 1 << 20
    registry: WorkerRegistry | None = None  # shown at /v1/workers
    metrics: GatewayMetrics | None = None  # shared with the backend's pool gauges; None: made for limits' model
    chat_parsers: ChatParsers = ChatParsers()  # reasoning and tool-call parsers of chat output
    # Origins whose browser pages may call the API (CORS, as vLLM's --allowed-origins); "*" any.
    # Empty: no CORS headers, so a page from another origin cannot read an answer.
    allowed_origins: list[str] = field(default_factory=list)
    # the Responses API's store (its budget: gateway.responses_store_mb)
    response_store: ResponseStore = field(
        default_factory=lambda: ResponseStore(GatewayConfig().responses_store_mb << 20)
    )
    tracer: Tracer = NO_TRACING  # request traces (observability.otlp_traces_endpoint); off by default
    lora_adapters: LoRAAdapters | None = None  # None: no LoRA (requests may name the base model only)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


async def read_json(request: Request, max_bytes: int):
    """The body parsed as JSON; 413 past ``max_bytes`` (checked before and while reading), 400 if malformed,
    415 when it is declared as something other than JSON (a browser may send text/plain or a form
    cross-site without a CORS preflight; refusing those keeps such pages from driving the API)."""
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415, f"content-type must be application/json, got {media_type[:100]!r}", code="unsupported_media_type"
        )
    too_large = APIError(413, f"request body is larger than the limit of {max_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        parsed = json.loads(body)
        # "\ud800" is valid JSON but not text: it would fail later, in the tokenizer or in the UTF-8
        # encoding of an error message that quotes it (a 500); refuse it here, as malformed input.
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        return parsed
    except UnicodeEncodeError:
        raise bad_request(
            "request body has a string with a lone surrogate (\\ud800-\\udfff); strings must be valid Unicode"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}") from None
    except RecursionError:  # json recurses once per nesting level: [[[[...]]]] must not be a 500
        raise bad_request("request body is nested too deeply") from None


def build_app(params: GatewayParams) -> Starlette:
    metrics = params.metrics or GatewayMetrics(params.limits.model_name, params.limits.max_model_len)
    serving = Serving(
        params.tokenizer,
        params.backend,
        params.limits,
        metrics,
        params.chat_parsers,
        params.response_store,
        params.tracer,
        params.lora_adapters,
    )
    keys = ApiKeys(params.api_keys)
    admin = AdminGate(params.admin_api_keys)
    metrics.stored_responses.set_function(lambda: len(serving.store))
    metrics.stored_responses_bytes.set_function(lambda: serving.store.num_bytes)
    metrics.background_responses.set_function(lambda: len(serving.background))
    if params.registry is not None:  # vllm:* engine gauges per pool, from the workers' heartbeats
        metrics.report_pools(lambda: [w.heartbeat for w in params.registry.workers()])
    limits = params.limits
    started = int(time.time())

    def authorize(request: Request) -> None:
        if not keys.check_header(request.headers.get("authorization")):
            raise APIError(
                401, "invalid or missing API key (expected 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    def authorize_anthropic(request: Request) -> None:
        """Anthropic's clients send the key bare in ``x-api-key``; a Bearer header works too."""
        if not (
            keys.check_key(request.headers.get("x-api-key")) or keys.check_header(request.headers.get("authorization"))
        ):
            raise APIError(
                401,
                "invalid or missing API key (expected 'x-api-key: <key>' or 'Authorization: Bearer <key>')",
                code="invalid_api_key",
            )

    def generate(dialect: Dialect):
        async def endpoint(request: Request):
            (authorize_anthropic if dialect.key_in_x_api_key else authorize)(request)
            return await serving.serve(request, await read_json(request, params.max_body_bytes), dialect)

        return endpoint

    async def count_message_tokens(request: Request):
        authorize_anthropic(request)
        return JSONResponse(serving.count_message_tokens(await read_json(request, params.max_body_bytes)))

    async def models(request: Request):
        authorize(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": limits.model_name,
                        "object": "model",
                        "created": started,
                        "owned_by": "pdserve",
                        "max_model_len": limits.max_model_len,
                    },
                    *serving.adapters.model_cards(started, limits.max_model_len),
                ],
            }
        )

    lora_changes = asyncio.Lock()

    async def load_lora_adapter(request: Request):
        """vLLM's runtime route: {"lora_name", "lora_path"}; every worker loads it before the answer."""
        admin.authorize(request, authorize)
        body = await read_json(request, params.max_body_bytes)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        adapters = serving.adapters
        name, path = body.get("lora_name"), body.get("lora_path")
        async with lora_changes:  # one change at a time here; the workers order other gateways' changes
            adapters.check_new(name, path)
            error = await params.backend.change_lora_adapters(name, path)
            if error:  # taken back from every worker: the list is as before
                await params.backend.change_lora_adapters(name, None)
                raise bad_request(f"LoRA adapter {name!r} could not be loaded: {error}", "lora_path")
            adapters.add(name, path)
        log.info("LoRA adapter %s loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: Request):
        admin.authorize(request, authorize)
        body = await read_json(request, params.max_body_bytes)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        adapters, name = serving.adapters, body.get("lora_name")
        async with lora_changes:
            if not isinstance(name, str) or name not in adapters.paths:
                raise APIError(
                    404,
                    f"The lora adapter '{str(name)[:200]}' cannot be found.",
                    param="lora_name",
                    code="model_not_found",
                )
            await params.backend.change_lora_adapters(name, None)
            adapters.remove(name)
        log.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def workers(request: Request):
        authorize(request)
        listed = params.registry.workers() if params.registry is not None else []
        return JSONResponse({"object": "list", "data": [w.as_json() for w in listed]})

    async def tokenize(request: Request):
        authorize(request)
        body = await read_json(request, params.max_body_bytes)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        serving.check_model(body.get("model"))
        f = Fields(body)
        chat = "messages" in body
        if not (chat or isinstance(body.get("prompt"), str)):
            raise bad_request("give prompt (a string) or messages", "prompt")
        # vLLM's defaults: a rendered chat template already holds its special tokens
        add_special = f.bool("add_special_tokens", not chat)
        text = serving.render(parse_chat_prompt(f, parse_tools(f.raw("tools")))) if chat else body["prompt"]
        ids = params.tokenizer.encode(text, add_special_tokens=add_special)
        reply = {"tokens": ids, "count": len(ids), "max_model_len": limits.max_model_len}
        if f.bool("return_token_strs", False):
            reply["token_strs"] = params.tokenizer.token_strs(ids)
        return JSONResponse(reply)

    async def detokenize(request: Request):
        authorize(request)
        body = await read_json(request, params.max_body_bytes)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("tokens must be a list of token ids", "tokens")
        serving.check_model(body.get("model"))
        ids = serving.tokenize_prompt(body["tokens"], "tokens") if body["tokens"] else []
        return JSONResponse({"prompt": params.tokenizer.decode(ids)})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def ready(request: Request):
        if params.backend.is_ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})

    async def metrics_endpoint(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def version(request: Request):
        return JSONResponse({"version": __version__})

    async def openapi(request: Request):
        return JSONResponse(openapi_spec())

    generation_paths = tuple(d.path for d in DIALECTS)

    def shaped(request: Request, e: APIError) -> JSONResponse:
        """The error JSON the route's dialect's clients read: OpenAI's, or Anthropic's on its Messages routes."""
        dialect = next((d for d in DIALECTS if request.url.path.startswith(d.path)), None)
        if dialect is not None:
            return JSONResponse(dialect.error_body(e), status_code=e.status, headers=e.headers())
        return error_response(e)

    async def on_api_error(request: Request, e: APIError):
        # 503 and generation failures are counted where they happen; here the requests refused up front
        if request.url.path in generation_paths and e.status < 500:
            metrics.requests.labels("invalid").inc()
        return shaped(request, e)

    async def on_http_error(request: Request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(
            {"error": {"message": str(e.detail)[:200], "type": "invalid_request_error", "param": None, "code": code}},
            status_code=e.status_code,
        )

    async def on_unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)  # the trace goes to the log, never the client
        return shaped(request, APIError(500, "internal server error", code="internal_error"))

    routes = [
        *(Route(d.path, generate(d), methods=["POST"]) for d in DIALECTS),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        *response_routes(serving.store, serving.background, authorize),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/workers", workers, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await params.backend.start()  # in the serving loop: the backend's sockets and tasks live there
        stop_listening = None
        if serving.store.is_shared:  # cancels of background responses asked of another replica
            loop = asyncio.get_running_loop()
            stop_listening = serving.store.listen_for_cancels(
                lambda rid: loop.call_soon_threadsafe(serving.background.cancel_soon, rid)
            )
        try:
            yield
        finally:
            if stop_listening is not None:
                stop_listening()
            await serving.background.cancel_all()  # their workers let go before the backend's sockets close
            await params.backend.stop()

    middleware = []
    if params.allowed_origins:
        # A preflight (OPTIONS) is answered here, before the key check: browsers send it without one.
        # Credentials stay off: the API key travels in a header the page sets, never in a cookie.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=params.allowed_origins,
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["*"],
                max_age=600,
            )
        )
    middleware.append(Middleware(RequestIdEcho, error_response=error_response))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected},
    )
    app.state.metrics = metrics
    app.state.serving = serving
    return app
