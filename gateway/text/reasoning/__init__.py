"""Reasoning outputs: a thinking model's reasoning goes to the message's ``reasoning`` field, the rest to
``content``, as vLLM's ``--reasoning-parser`` does (``gateway.reasoning_parser``).

One file per parser, each a ``ReasoningParser`` (base.py); ``PARSERS`` below names them (a new parser is
one new file, one line there and its name in configs/schema.py's choices).
"""

from __future__ import annotations

from .base import ReasoningParser
from .think_tags import ThinkTagParser

# gateway.reasoning_parser (vLLM's --reasoning-parser) -> its parser
PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ThinkTagParser,
    "qwen3": ThinkTagParser,
}
REASONING_PARSERS = tuple(PARSERS)

__all__ = ["ReasoningParser", "PARSERS", "REASONING_PARSERS"]
