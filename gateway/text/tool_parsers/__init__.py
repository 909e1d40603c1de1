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

One file per reader, each a ``ToolCallParser`` (base.py); ``PARSERS`` below names them (a new reader is
one new file, one line there and its name in configs/schema.py's choices). Each reads one choice's text as
it streams, ``feed(text, final)`` -> (content, calls), a call being a finished (name, arguments JSON) pair.
Text that may still become a call is held back; what turns out not to be one (JSON that does not parse,
or is not a call) goes out as content, so nothing is lost. A hermes or qwen3_coder call goes out when its
closing tag arrives (deepseek_v3's calls when their block closes), and the space around calls is
dropped; a llama3_json, pythonic or granite output, once it starts with "{" or "[", only at the end (it is a
call only if the whole of it parses). Mistral's text before [TOOL_CALLS] streams as it comes; what
follows it is read at the end, where the calls go out, with any text after them as content.
"""

from __future__ import annotations

from .base import Call, ToolCallParser
from .deepseek_v3 import DeepSeekV3Reader
from .granite import GraniteReader
from .hermes import HermesReader
from .llama3_json import Llama3JsonReader
from .mistral import MistralReader
from .pythonic import PythonicReader
from .qwen3_coder import Qwen3CoderReader

# gateway.tool_call_parser (vLLM's --tool-call-parser) -> its reader
PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesReader,
    "llama3_json": Llama3JsonReader,
    "pythonic": PythonicReader,
    "mistral": MistralReader,
    "qwen3_coder": Qwen3CoderReader,
    "deepseek_v3": DeepSeekV3Reader,
    "granite": GraniteReader,
}
TOOL_CALL_PARSERS = tuple(PARSERS)
READS_SPECIAL_TOKENS = frozenset(name for name, reader in PARSERS.items() if reader.reads_special_tokens)

__all__ = ["Call", "ToolCallParser", "PARSERS", "TOOL_CALL_PARSERS", "READS_SPECIAL_TOKENS", "make_reader"]


def make_reader(name: str, tools: list[dict] | None = None) -> ToolCallParser:
    """The reader of one choice; ``tools``: the request's, in chat form (qwen3_coder types its values by them)."""
    return PARSERS[name](tools)
