"""pythonic (Llama 3.2/4, ToolACE): the whole output is a Python list [f(a=1, b="x"), g()] (Llama 4 may
wrap it in <|python_start|> .. <|python_end|>), read with ``ast`` and never run."""

from __future__ import annotations

import ast
import json

from .base import Call, WholeOutputReader


class PythonicReader(WholeOutputReader):
    # Llama 4's special tokens around the list: the detokenizer usually drops them already
    TAGS, OPEN, END = ("<|python_start|>",), "[", "<|python_end|>"

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        text = text.strip().removeprefix(self.TAGS[0]).strip().removesuffix(self.END)
        return _parse_pythonic(text.strip())


def _parse_pythonic(text: str) -> list[Call] | None:
    """A Python list of calls, ``[f(a=1, b="x"), g()]``, read with ``ast`` and never run; None unless all
    of the text is that."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL in the text
        return None
    if not (isinstance(tree, ast.List) and tree.elts):
        return None
    calls = [_pythoniccall_of(node) for node in tree.elts]
    return None if None in calls else calls


def _pythoniccall_of(node: ast.expr) -> Call | None:
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
