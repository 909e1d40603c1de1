"""A small hand-written OpenAPI description of the gateway's routes (served at /openapi.json)."""

from __future__ import annotations

from gateway import __version__
from gateway.dialects.openai.request import MAX_LOGPROBS
from protocol.serving import MAX_CACHE_SALT_CHARS, MAX_LORA_NAME_CHARS

_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERROR = {"description": "OpenAI error object", "content": _JSON}


# Request bodies with vLLM's ranges (gateway/dialects/openai/request.py enforces them): fuzzers such as
# schemathesis generate from these, so the closer they are, the deeper the generated requests reach.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_CHOICES = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}},
    },
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "allowed_token_ids": {"oneOf": [{"type": "null"}, {**_TOKEN_IDS, "minItems": 1}]},
    "include_stop_str_in_output": {"type": "boolean"},
    "stop_token_ids": _TOKEN_IDS,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 2.0**-16, "maximum": 2.0**16},
    "ignore_eos": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    "return_tokens_as_token_ids": {"type": "boolean"},
    "truncate_prompt_tokens": {"type": "integer", "minimum": -1},
    "min_tokens": {"type": "integer", "minimum": 0},
    "user": {"type": "string"},
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
    # vLLM's: each prompt token's logprob and rank plus the top k; not with stream (400)
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    # vLLM's: prefix KV is shared only between requests with the same salt (tenant isolation)
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS},
    # structured outputs (gateway/dialects/openai/structured_fields.py): one of these per request
    "response_format": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}},
            },
        },
    },
    "structured_outputs": {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {
            "json": {"type": "object"},
            "json_object": {"const": True},
            "regex": {"type": "string", "minLength": 1},
            "choice": _CHOICES,
            "grammar": {"type": "string", "minLength": 1},
        },
    },
    "guided_json": {"type": "object"},
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_choice": _CHOICES,
    "guided_grammar": {"type": "string", "minLength": 1},
}
_PROMPT = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS},
    ]
}
_MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}},
    },
}
_TOOLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}, "parameters": {"type": "object"}},
            },
        },
    },
}
# vLLM's: how the chat template renders the messages (gateway/dialects/openai/chat_prompt.py)
_TEMPLATE = {
    "add_generation_prompt": {"type": "boolean"},
    "continue_final_message": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object"},
}
_ANTHROPIC_TEXT = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            },
        },
    ]
}
_ANTHROPIC_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant"]},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type"],
                            "properties": {
                                "type": {"enum": ["text", "tool_use", "tool_result", "thinking"]},
                                "text": {"type": "string"},
                                "id": {"type": "string"},
                                "name": {"type": "string"},
                                "input": {"type": "object"},
                                "tool_use_id": {"type": "string"},
                                "content": {"type": "string"},
                            },
                        },
                    },
                ]
            },
        },
    },
}

_BODIES = {
    "completion": {
        "required": ["prompt"],
        "properties": {
            **_SAMPLING,
            "prompt": _PROMPT,
            "logprobs": {"type": "integer", "minimum": 0},
            "echo": {"type": "boolean"},
        },
    },  # the prompt leads each choice's text and logprobs
    "chat": {
        "required": ["messages"],
        "properties": {
            **_SAMPLING,
            **_TEMPLATE,
            "messages": _MESSAGES,
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0},
            # tool calls (gateway/text/tool_calls.py): forced, or "auto" where gateway.tool_call_parser is set
            # (else a 400)
            "tools": _TOOLS,
            "parallel_tool_calls": {"type": "boolean"},
            "tool_choice": {
                "oneOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "function"},
                            "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                        },
                    },
                ]
            },
            "include_reasoning": {"type": "boolean"},  # vLLM's: False drops what a reasoning parser splits off
            "echo": {"type": "boolean"},
        },
    },  # vLLM's: the reply starts with the assistant message it continues
    # the Responses API (gateway/dialects/responses/request.py): read as the chat request it amounts to, after the
    # stored chain previous_response_id names (gateway/dialects/responses/store.py)
    "responses": {
        "required": ["input"],
        "properties": {
            **{
                k: v
                for k, v in _SAMPLING.items()
                if k not in ("max_tokens", "n", "stream_options", "prompt_logprobs", "response_format")
            },
            "input": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
                                "role": {"enum": ["system", "developer", "user", "assistant"]},
                                "content": {"type": "string"},
                                "call_id": {"type": "string"},
                                "name": {"type": "string"},
                                "arguments": {"type": "string"},
                                "output": {"type": "string"},
                            },
                        },
                    },
                ]
            },
            "instructions": {"type": "string"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "tools": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {
                        "type": {"const": "function"},
                        "name": {"type": "string", "minLength": 1},
                        "parameters": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
            "tool_choice": {
                "oneOf": [
                    {"enum": ["none", "auto", "required"]},
                    {"type": "object", "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
                ]
            },
            "parallel_tool_calls": {"type": "boolean"},
            "text": {
                "type": "object",
                "properties": {
                    "format": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {
                            "type": {"enum": ["text", "json_object", "json_schema"]},
                            "name": {"type": "string"},
                            "schema": {"type": "object"},
                            "strict": {"type": "boolean"},
                        },
                    }
                },
            },
            "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string"}},
            "store": {"type": "boolean"},
            "background": {"type": "boolean"},
            "previous_response_id": {"type": "string"},
            "truncation": {"enum": ["auto", "disabled"]},
            "include_reasoning": {"type": "boolean"},
        },
    },
    # Anthropic's Messages API (gateway/dialects/anthropic/request.py): read as the chat request it amounts to
    "messages": {
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            **{
                k: v
                for k, v in _SAMPLING.items()
                if k not in ("max_tokens", "n", "stream_options", "prompt_logprobs", "response_format", "stop")
            },
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": _ANTHROPIC_MESSAGES,
            "system": _ANTHROPIC_TEXT,
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "tools": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "input_schema"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "description": {"type": "string"},
                        "input_schema": {"type": "object"},
                    },
                },
            },
            "tool_choice": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"enum": ["auto", "any", "tool", "none"]},
                    "name": {"type": "string"},
                    "disable_parallel_tool_use": {"type": "boolean"},
                },
            },
            "thinking": {
                "type": "object",
                "properties": {
                    "type": {"enum": ["enabled", "disabled", "adaptive"]},
                    "budget_tokens": {"type": "integer"},
                },
            },
            "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
        },
    },
    "count_tokens": {
        "required": ["model", "messages"],
        "properties": {"model": {"type": "string"}, "messages": _ANTHROPIC_MESSAGES, "system": _ANTHROPIC_TEXT},
    },
    "tokenize": {
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "messages": _MESSAGES,
            **_TEMPLATE,
            "tools": _TOOLS,
            "add_special_tokens": {"type": "boolean"},
            "return_token_strs": {"type": "boolean"},
        }
    },
    "detokenize": {"required": ["tokens"], "properties": {"model": {"type": "string"}, "tokens": _TOKEN_IDS}},
    # vLLM's runtime LoRA routes (gateway/serving/lora_adapters.py); 200 answers are text
    "load_lora_adapter": {
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string", "minLength": 1, "maxLength": MAX_LORA_NAME_CHARS},
            "lora_path": {"type": "string", "minLength": 1},
        },
    },
    "unload_lora_adapter": {"required": ["lora_name"], "properties": {"lora_name": {"type": "string"}}},
}


def _post(summary: str, body: str) -> dict:
    content = {"application/json": {"schema": {"type": "object", **_BODIES[body]}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": content},
            "responses": {
                "200": {"description": "OK (text/event-stream when stream is true)", "content": _JSON},
                "400": _ERROR,
                "401": _ERROR,
                "404": _ERROR,
                "413": _ERROR,
                "503": _ERROR,
            },
        }
    }


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_INPUT_ITEMS_QUERY = [
    {"name": "after", "in": "query", "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
]


def _stored(method: str, summary: str, query: list[dict] = ()) -> dict:
    return {
        method: {
            "summary": summary,
            "parameters": [_RESPONSE_ID, *query],
            "responses": {"200": {"description": "OK", "content": _JSON}, "400": _ERROR, "401": _ERROR, "404": _ERROR},
        }
    }


def openapi_spec() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve gateway", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _post("Text completion (OpenAI compatible)", "completion"),
            "/v1/chat/completions": _post("Chat completion (OpenAI compatible)", "chat"),
            "/v1/responses": _post(
                "Responses API: the conversation is input, after a stored previous response's", "responses"
            ),
            "/v1/messages": _post("Anthropic's Messages API (the key in x-api-key or a Bearer header)", "messages"),
            "/v1/messages/count_tokens": _post("Anthropic's count_tokens: the prompt's tokens", "count_tokens"),
            "/v1/responses/{response_id}": {
                **_stored("get", "A stored response"),
                **_stored("delete", "Delete a stored response"),
            },
            "/v1/responses/{response_id}/input_items": _stored(
                "get", "A stored response's input items, a page", _INPUT_ITEMS_QUERY
            ),
            "/v1/responses/{response_id}/cancel": _stored("post", "Cancel a background response still running"),
            "/v1/models": _get("Served models"),
            "/v1/workers": _get("Registered prefill and decode workers"),
            "/v1/load_lora_adapter": _post("Load a LoRA adapter on every worker (--enable-lora)", "load_lora_adapter"),
            "/v1/unload_lora_adapter": _post("Unload a LoRA adapter from every worker", "unload_lora_adapter"),
            "/tokenize": _post("Prompt or messages to token ids", "tokenize"),
            "/detokenize": _post("Token ids to text", "detokenize"),
            "/health": _get("Liveness"),
            "/ready": _get("Readiness: 200 once a worker can serve, else 503"),
            "/metrics": _get("Prometheus metrics"),
            "/version": _get("Gateway version"),
        },
    }
