"""qwen3_coder (Qwen3-Coder): text, then <tool_call><function=f><parameter=a>text</parameter>..</function>
</tool_call> .., each value raw text, typed by the request's schema of its parameter."""

from __future__ import annotations

import ast
import json
import math
import re

from .base import Call
from .hermes import HermesReader


class Qwen3CoderReader(HermesReader):
    """Hermes' tags around XML-like calls, the values raw text: the request's tools type them."""

    __slots__ = ("_properties",)

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._properties: dict[str, dict] = {}  # function name -> its parameters' schemas
        for tool in tools or ():
            fn = tool.get("function") or {}
            properties = (fn.get("parameters") or {}).get("properties")
            self._properties[fn.get("name")] = properties if isinstance(properties, dict) else {}

    def _parse(self, body: str, closed: bool) -> list[Call]:
        calls = []
        # several functions in one <tool_call> are several calls, text around them is ignored (as vLLM)
        for function in _QWEN_FUNCTION.finditer(body):
            # a parameter ends at its closing tag, or where the next one or the function's end begins; one
            # left open at the end of a cut-off output is dropped: its value may be cut short
            done = closed or bool(function[3])
            properties = self._properties.get(function[1], {})
            arguments = {}
            for parameter in _QWEN_PARAMETER.finditer(function[2]):
                if parameter[3] or parameter.end() < len(function[2]) or done:
                    value = parameter[2].removeprefix("\n").removesuffix("\n")
                    arguments[parameter[1]] = _typed(value, properties.get(parameter[1]))
            calls.append((function[1], json.dumps(arguments, ensure_ascii=False)))
        return calls


# A name may not hold "<" or ">": "<function=f" cut off at the end is no function, so the text goes back.
_QWEN_FUNCTION = re.compile(r"<function=([^<>]+)>(.*?)(</function>|\Z)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^<>]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _typed(value: str, schema) -> object:
    """A parameter's raw text as the value its schema's type asks for, as vLLM converts it: the text
    itself where that does not read (and for parameters the schema does not name, or gives no type)."""
    kind = (
        schema.get("type", "object" if "anyOf" in schema or "oneOf" in schema else "string")
        if isinstance(schema, dict)
        else "string"
    )
    if value.lower() == "null":
        return None
    if kind == "string":
        return value
    if kind == "boolean":  # vLLM reads anything but true as false
        return value.lower() == "true"
    if kind in ("integer", "number"):
        try:
            number = int(value) if kind == "integer" else float(value)
        except ValueError:
            return value
        if kind == "integer":
            return number
        # JSON has no inf or nan; a whole number goes out without ".0", as vLLM's does
        return value if not math.isfinite(number) else int(number) if number.is_integer() else number
    # object, array, a union, or a type vLLM does not name: JSON, else a Python literal (read with ast,
    # never run), else the text; a result JSON cannot hold (a set, NaN) stays the text
    for read in (json.loads, ast.literal_eval):
        try:
            parsed = read(value)
            json.dumps(parsed, allow_nan=False)
            return parsed
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return value
