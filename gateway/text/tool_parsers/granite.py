"""granite (Granite 3.x): the whole output is [{"name": .., "arguments": {..}}, ..], after <tool_call>
(3.1 on) or the <|tool_call|> special token (3.0, usually dropped by the detokenizer)."""

from __future__ import annotations

from .base import Call, WholeOutputReader, json_array


class GraniteReader(WholeOutputReader):
    TAGS, OPEN = ("<tool_call>", "<|tool_call|>"), "["  # 3.1 on; 3.0's special token, where it is kept

    __slots__ = ()

    def _parse(self, text: str) -> list[Call] | None:
        text = text.strip()
        for tag in self.TAGS:
            text = text.removeprefix(tag)
        read = json_array(text)
        return read[0] if read is not None and not read[1].strip() else None
