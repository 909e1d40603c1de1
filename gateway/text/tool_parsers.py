"""Readers of a model's own tool calls in free text, for ``tool_choice: "auto"``, as vLLM's
``--tool-call-parser`` (``gateway.tool_call_parser``):

    hermes        Qwen2.5/Qwen3, Hermes: text, then <tool_call>{"name": .., "arguments": {..}}</tool_call> ...
    llama3_json   Llama 3.1-3.3: the whole output is {"name": .., "parameters": {..}} (several joined by ";")
    pythonic      Llama 3.2/4, ToolACE: the whole output is a Python list [f(a=1, b="x"), g()] (Llama 4 may
                  wrap it in <|python_start|> .. <|python_end|>)
    mistral       Mistral: text, then [TOOL_CALLS][{"name": .., "arguments": {..}}, ..] (tokenizers before v11)
                  or [TOOL_CALLS]f{..}[TOOL_CALLS]g{..} (v11 on; [CALL_ID]id and [ARGS] may stand before {..})
    qwen3_coder   Qwen3-Coder: text, then <tool_call><function=f><parameter=a>text</parameter>..</function>
                  </tool_call> .., each value raw text, typed by the request's schema of its parameter
    granite       Granite 3.x: the whole output is [{"name": .., "arguments": {..}}, ..], after <tool_call>
                  (3.1 on) or the <|tool_call|> special token (3.0, usually dropped by the detokenizer)
    deepseek_v3   DeepSeek-V3/R1: text, then <｜tool▁calls▁begin｜>, per call <｜tool▁call▁begin｜>function
                  <｜tool▁sep｜>f, a ```json fenced {..} and <｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>;
                  V3.1's shorter <｜tool▁call▁begin｜>f<｜tool▁sep｜>{..}<｜tool▁call▁end｜> too

Each reads one choice's text as it streams, ``feed(text, final)`` -> (content, calls), a call being a
finished (name, arguments JSON) pair. Text that may still become a call is held back; what turns out
not to be one (JSON that does not parse, or is not a call) goes out as content, so nothing is lost.
A hermes or qwen3_coder call goes out when its closing tag arrives (deepseek_v3's calls when their
block closes), and the space around calls is
dropped; a llama3_json, pythonic or granite output, once it starts with "{" or "[", only at the end (it is a
call only if the whole of it parses). Mistral's text before [TOOL_CALLS] streams as it comes; what
follows it is read at the end, where the calls go out, with any text after them as content.
"""

from __future__ import annotations

import ast
import json
import math
import re

from .stop_strings import cut_at

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "granite")
# Parsers whose markers are special tokens, which the detokenizer would otherwise drop (vLLM's mistral
# parser turns skip_special_tokens off for the same reason).
READS_SPECIAL_TOKENS = frozenset({"mistral", "deepseek_v3"})
Call = tuple[str, str]  # (function name, arguments as a JSON text)


def _call(obj, arguments_keys: tuple[str, ...]) -> Call | None:
    """A call from a decoded {"name": str, <an arguments key>: object}; None if it is not one."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class _SpaceAroundCalls:
    """The text outside the calls to pass on, for readers whose calls stand among text. The space around
    calls is not an answer: space at the end is held until more text comes, and dropped at the end
    where there were calls (the reader adds ``_gap`` to its last content where there were none)."""

    __slots__ = ("_gap",)

    def __init__(self) -> None:
        self._gap = ""

    def _outside(self, text: str) -> str:
        self._gap += text
        ready = self._gap.rstrip()
        self._gap = self._gap[len(ready):]
        return ready


class HermesReader(_SpaceAroundCalls):
    START, END = "<tool_call>", "</tool_call>"

    __slots__ = ("_pending", "_in_call", "_has_calls")

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._in_call = False
        self._has_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending, self._pending = self._pending + text, ""
        content, calls = "", []
        while pending or self._in_call:
            if not self._in_call:
                head, pending, found = cut_at(pending, self.START, final)
                content += self._outside(head)
                if not found:
                    break
                self._in_call = True
                continue
            body, rest, closed = cut_at(pending, self.END, final)
            if not (closed or final):
                pending = body + rest  # the call is still coming
                break
            read = self._parse(body, closed)
            if not read:  # not a call: give the text back as it came
                content += self._outside(self.START + body + (self.END if closed else ""))
            else:
                calls += read
                self._has_calls = True
            self._in_call, pending = False, rest
        self._pending = pending
        if final and not self._has_calls:
            content, self._gap = content + self._gap, ""
        return content, calls

    def _parse(self, body: str, closed: bool) -> list[Call]:
        """The calls in the text between the tags (``closed``: the closing tag came); none: not a call."""
        call = _parse_one(body)
        return [] if call is None else [call]


def _parse_one(body: str) -> Call | None:
    try:
        return _call(json.loads(body), ("arguments", "parameters"))
    except (ValueError, RecursionError):  # RecursionError: nested past what json decodes
        return None


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


class DeepSeekV3Reader(HermesReader):
    """Hermes' reading between DeepSeek's block markers; every complete call inside must parse, else the
    block is text. A call cut off at the end of the output is dropped, as its arguments may be cut short."""

    START, END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"

    def _parse(self, body: str, closed: bool) -> list[Call]:
        calls = []
        for match in _DEEPSEEK_CALL.finditer(body):
            head, arguments = match[1].strip(), match[2]
            fenced = _DEEPSEEK_FENCED.fullmatch(arguments) if head == "function" else None
            name, arguments = (fenced[1].strip(), fenced[2]) if fenced else (head, arguments)  # V3, else V3.1
            try:
                call = _call({"name": name, "arguments": json.loads(arguments)}, ("arguments",))
            except (ValueError, RecursionError):  # RecursionError: nested past what json decodes
                call = None
            if call is None:
                return []
            calls.append(call)
        return calls


_DEEPSEEK_CALL = re.compile("<\uff5ctool\u2581call\u2581begin\uff5c>(.*?)<\uff5ctool\u2581sep\uff5c>(.*?)"
                            "<\uff5ctool\u2581call\u2581end\uff5c>", re.DOTALL)
_DEEPSEEK_FENCED = re.compile(r"([^`]+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


# A name may not hold "<" or ">": "<function=f" cut off at the end is no function, so the text goes back.
_QWEN_FUNCTION = re.compile(r"<function=([^<>]+)>(.*?)(</function>|\Z)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^<>]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _typed(value: str, schema) -> object:
    """A parameter's raw text as the value its schema's type asks for, as vLLM converts it: the text
    itself where that does not read (and for parameters the schema does not name, or gives no type)."""
    kind = schema.get("type", "object" if "anyOf" in schema or "oneOf" in schema else "string") \
        if isinstance(schema, dict) else "string"
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


class _WholeOutputReader:
    """An output that is calls only as a whole: once it starts (after space) with one of ``TAGS`` or with
    ``OPEN`` it is held to the end and read by ``_parse``; anything else streams on as content at once."""

    TAGS: tuple[str, ...] = ()
    OPEN = ""

    __slots__ = ("_pending", "_state")

    def __init__(self) -> None:
        self._pending = ""
        self._state = "start"  # "start" (nothing but space yet) | "calls" | "content"

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending = self._pending + text
        if self._state == "start":
            lead = pending.lstrip()
            if lead.startswith((*self.TAGS, self.OPEN)):
                self._state = "calls"
            elif not final and (not lead or any(tag.startswith(lead) for tag in self.TAGS)):
                self._pending = pending
                return "", []
            else:
                self._state = "content"
        if self._state == "content":
            self._pending = ""
            return pending, []
        if not final:
            self._pending = pending
            return "", []
        self._pending = ""
        calls = self._parse(pending)
        return ("", calls) if calls else (pending, [])

    def _parse(self, text: str) -> list[Call] | None:
        raise NotImplementedError


class Llama3JsonReader(_WholeOutputReader):
    TAGS, OPEN = ("<|python_tag|>",), "{"  # a special token: the detokenizer usually drops it already

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        return _parse_joined(text.lstrip().removeprefix(self.TAGS[0]))


def _parse_joined(text: str) -> list[Call] | None:
    """JSON call objects one after another, separated by ";" and space; None unless all of it is that."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


class PythonicReader(_WholeOutputReader):
    # Llama 4's special tokens around the list: the detokenizer usually drops them already
    TAGS, OPEN, END = ("<|python_start|>",), "[", "<|python_end|>"

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        text = text.strip().removeprefix(self.TAGS[0]).strip().removesuffix(self.END)
        return _parse_pythonic(text.strip())


class GraniteReader(_WholeOutputReader):
    TAGS, OPEN = ("<tool_call>", "<|tool_call|>"), "["  # 3.1 on; 3.0's special token, where it is kept

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        text = text.strip()
        for tag in self.TAGS:
            text = text.removeprefix(tag)
        read = _json_array(text)
        return read[0] if read is not None and not read[1].strip() else None


def _parse_pythonic(text: str) -> list[Call] | None:
    """A Python list of calls, ``[f(a=1, b="x"), g()]``, read with ``ast`` and never run; None unless all
    of the text is that."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL in the text
        return None
    if not (isinstance(tree, ast.List) and tree.elts):
        return None
    calls = [_pythonic_call(node) for node in tree.elts]
    return None if None in calls else calls


def _pythonic_call(node: ast.expr) -> Call | None:
    """``name(key=literal, ..)``: a plain name and keyword arguments only, each value a literal (strings,
    numbers, True/False/None, and lists, tuples and dicts of them); None if it is anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:  # f(**more), or a name given twice
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)  # names, calls, operators: ValueError
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:  # tuples become lists; sets, bytes, complex numbers and inf/nan have no JSON: not a call
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


class MistralReader(_SpaceAroundCalls):
    MARKER = "[TOOL_CALLS]"

    __slots__ = ("_pending", "_in_calls")

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._in_calls = False  # past the first [TOOL_CALLS]: the rest is held to the end

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        pending, self._pending = self._pending + text, ""
        content, calls = "", []
        if not self._in_calls:
            head, pending, self._in_calls = cut_at(pending, self.MARKER, final)
            content += self._outside(head)
        if not (self._in_calls and final):
            self._pending = pending  # a possible start of the marker, or the calls still coming
        else:
            read = _parse_mistral(pending)
            if read is None:  # not calls: give the text back as it came
                content += self._outside(self.MARKER + pending)
            else:
                calls, after = read
                content += self._outside(after)
        if final and not calls:
            content, self._gap = content + self._gap, ""
        return content, calls


def _parse_mistral(text: str) -> tuple[list[Call], str] | None:
    """The calls after the first [TOOL_CALLS] and the text after the last of them; None unless each
    [TOOL_CALLS] is followed by calls, with only space between."""
    calls: list[Call] = []
    after = ""
    for part in text.split(MistralReader.MARKER):
        if after.strip():  # text between calls: not the format
            return None
        read = _json_array(part) if part.lstrip().startswith("[") else _mistral_named(part)
        if read is None:
            return None
        calls += read[0]
        after = read[1]
    return calls, after


def _json_array(part: str) -> tuple[list[Call], str] | None:
    """A JSON array of {"name": .., "arguments": {..}} (mistral before tokenizer v11, granite), and the text
    after it."""
    part = part.lstrip()
    try:
        items, end = json.JSONDecoder().raw_decode(part)
    except (ValueError, RecursionError):
        return None
    calls = [_call(item, ("arguments",)) for item in items] if isinstance(items, list) else []
    return (calls, part[end:]) if calls and None not in calls else None


# v11 on: the name, then the arguments object; where the tokenizer's control tokens are kept in the text,
# [CALL_ID] and the call's id (ours are made by the gateway) and [ARGS] stand between them
_NAMED_CALL = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\]\s*)?(?=\{)")


def _mistral_named(part: str) -> tuple[list[Call], str] | None:
    """Tokenizers v11 on: ``name{..}``, and the text after it."""
    match = _NAMED_CALL.match(part)
    if match is None:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(part, match.end())
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return [(match[1], json.dumps(arguments, ensure_ascii=False))], part[end:]


Reader = (HermesReader | Llama3JsonReader | PythonicReader | MistralReader | Qwen3CoderReader | DeepSeekV3Reader
          | GraniteReader)
_READERS = {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "pythonic": PythonicReader,
            "mistral": MistralReader, "deepseek_v3": DeepSeekV3Reader, "granite": GraniteReader}


def make_reader(name: str, tools: list[dict] | None = None) -> Reader:
    """``tools``: the request's, in chat form; only qwen3_coder reads them (its values are untyped text)."""
    return Qwen3CoderReader(tools) if name == "qwen3_coder" else _READERS[name]()
