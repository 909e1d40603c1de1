"""deepseek_v3 (DeepSeek-V3/R1): text, then <｜tool▁calls▁begin｜>, per call <｜tool▁call▁begin｜>function
<｜tool▁sep｜>f, a ```json fenced {..} and <｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>; V3.1's shorter
<｜tool▁call▁begin｜>f<｜tool▁sep｜>{..}<｜tool▁call▁end｜> too."""

from __future__ import annotations

import json
import re

from .base import Call, call_of
from .hermes import HermesReader


class DeepSeekV3Reader(HermesReader):
    """Hermes' reading between DeepSeek's block markers; every complete call inside must parse, else the
    block is text. A call cut off at the end of the output is dropped, as its arguments may be cut short."""

    reads_special_tokens = True
    START, END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"

    def _parse(self, body: str, closed: bool) -> list[Call]:
        calls = []
        for match in _DEEPSEEK_CALL.finditer(body):
            head, arguments = match[1].strip(), match[2]
            fenced = _DEEPSEEK_FENCED.fullmatch(arguments) if head == "function" else None
            name, arguments = (fenced[1].strip(), fenced[2]) if fenced else (head, arguments)  # V3, else V3.1
            try:
                call = call_of({"name": name, "arguments": json.loads(arguments)}, ("arguments",))
            except (ValueError, RecursionError):  # RecursionError: nested past what json decodes
                call = None
            if call is None:
                return []
            calls.append(call)
        return calls


_DEEPSEEK_CALL = re.compile(
    "<\uff5ctool\u2581call\u2581begin\uff5c>(.*?)<\uff5ctool\u2581sep\uff5c>(.*?)<\uff5ctool\u2581call\u2581end\uff5c>",
    re.DOTALL,
)
_DEEPSEEK_FENCED = re.compile(r"([^`]+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
