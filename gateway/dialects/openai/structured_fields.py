"""Structured-output fields of a request body -> one ``StructuredOutput``, or a 400 naming the field.

Three spellings reach the same grammar, as in vLLM; a request may use one of them:

    response_format   OpenAI: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs  vLLM: {"json": schema} | {"json_object": true} | {"regex": str} | {"choice": [str]}
                        | {"grammar": EBNF}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older top-level fields

Here only the shape is checked (JSON that parses, a list of strings, the size). Whether the grammar
compiles is the decode worker's to say, at admission and before any work: its refusal comes back as a
400 with xgrammar's reason. (xgrammar brings in torch, which the gateway does without.)
"""

from __future__ import annotations

import json
from typing import Any

from gateway.http.errors import bad_request
from gateway.http.request_fields import Fields
from protocol.serving import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutput

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def parse_structured_output(f: Fields) -> StructuredOutput | None:
    """The grammar the request's output must follow; None for free text."""
    found = [
        (spec, name)
        for spec, name in (_from_response_format(f), _from_structured_outputs(f), _from_guided(f))
        if spec is not None
    ]
    if len(found) > 1:
        raise bad_request(f"{found[0][1]} and {found[1][1]} both ask for a structured output; use one", found[1][1])
    return found[0][0] if found else None


def _from_response_format(f: Fields) -> tuple[StructuredOutput | None, str]:
    name = "response_format"
    rf = f.object(name)
    kind = rf.raw("type") if rf is not None else "text"
    if kind == "text":
        return None, name
    if kind == "json_object":
        return StructuredOutput("json_object"), name
    if kind != "json_schema":
        raise bad_request(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}", name
        )
    js = rf.object("json_schema")
    if js is None or js.raw("schema") is None:
        raise bad_request("response_format of type 'json_schema' needs json_schema.schema", name)
    return _json(js.raw("schema"), name), name


def _from_structured_outputs(f: Fields) -> tuple[StructuredOutput | None, str]:
    name = "structured_outputs"
    so = f.object(name)
    if so is None:
        return None, name
    asked = [key for key in (*_STRUCTURED_KEYS, "json_object") if so.has(key)]
    if len(asked) != 1:
        raise bad_request(
            f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
            f"got {asked or 'none'}",
            name,
        )
    key = asked[0]
    if key == "json_object":
        if so.raw(key) is not True:
            raise bad_request("structured_outputs.json_object must be true when given", name)
        return StructuredOutput("json_object"), name
    return _spec(_STRUCTURED_KEYS[key], so.raw(key), f"{name}.{key}", name), name


def _from_guided(f: Fields) -> tuple[StructuredOutput | None, str]:
    asked = [name for name in _GUIDED if f.has(name)]
    if len(asked) > 1:
        raise bad_request(f"{asked[0]} and {asked[1]} both ask for a structured output; use one", asked[1])
    if not asked:
        return None, ""
    name = asked[0]
    return _spec(_GUIDED[name], f.raw(name), name, name), name


def _spec(kind: str, value: Any, what: str, param: str) -> StructuredOutput:
    if kind == "json":
        return _json(value, param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"{what} must be a non-empty list of non-empty strings", param)
        return _sized("choice", json.dumps(value, ensure_ascii=False), param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{what} must be a non-empty string", param)
    return _sized(kind, value, param)


def _json(schema: Any, param: str) -> StructuredOutput:
    """A JSON schema given as an object (or a boolean), or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request("the JSON schema is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request("the JSON schema must be an object", param)
    return _sized("json", json.dumps(schema, ensure_ascii=False), param)


def _sized(kind: str, text: str, param: str) -> StructuredOutput:
    if len(text) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise bad_request(
            f"the {kind} grammar has {len(text)} characters; at most {MAX_STRUCTURED_OUTPUT_CHARS} are accepted", param
        )
    return StructuredOutput(kind, text)
