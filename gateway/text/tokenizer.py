"""A checkpoint's tokenizer and chat template, loaded without transformers (which may import torch).

Reads what ``save_pretrained`` writes: ``tokenizer.json`` (run by the ``tokenizers`` library) and
``tokenizer_config.json`` (special tokens, cleanup flag, chat template, unless the template lives in
``chat_template.jinja``). The template is rendered the way ``transformers.apply_chat_template`` renders
it: a sandboxed, immutable Jinja environment with trim_blocks/lstrip_blocks, ``raise_exception``,
a JSON ``tojson`` and ``strftime_now``, and the special tokens as template variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The chat template refused the messages (``raise_exception``) or is missing."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value) -> str | None:
    # Older configs store special tokens as AddedToken dicts: {"content": "<s>", ...}
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(raw) -> str | None:
    # tokenizer_config.json may hold one template or a list of named ones; "default" is the chat one
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default")
    return raw if isinstance(raw, str) else None


def load_chat_template(given: str) -> str:
    """The template vLLM's --chat-template names: a file's contents, or the text itself when it is
    Jinja. A path that does not exist is an error rather than a one-line template of its name."""
    if Path(given).is_file():
        return Path(given).read_text(encoding="utf-8")
    if "{" in given:
        return given
    raise ValueError(f"chat template {given!r} is neither a file nor a Jinja template")


def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization: undo the spaces old tokenizers put before punctuation
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


# Marks the end of the final message for continue_final_message, as transformers marks it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str) -> str:
    """``text`` up to the tag that ends the final message. A template that strips messages (Llama 3.1's
    does) takes the tag's space, and the message's trailing space with it: then so does the cut."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not show the final message's text")
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _embedding_rows(path: Path) -> int | None:
    """The model's vocab_size from config.json (its embedding rows); None without one (a bare tokenizer)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rows = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return rows if isinstance(rows, int) and rows > 0 else None


class Tokenizer:
    """Encode, decode and chat-template one checkpoint's tokenizer."""

    def __init__(self, path: str | Path, chat_template: str = "") -> None:
        """``chat_template``: vLLM's --chat-template (a file, or the template text) over the model's own."""
        path = Path(path)
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        jinja_path = path / "chat_template.jinja"
        source = (
            jinja_path.read_text(encoding="utf-8")
            if jinja_path.exists()
            else _pick_template(config.get("chat_template"))
        )
        source = load_chat_template(chat_template) if chat_template else source
        self._template = _compile_template(source) if source else None
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        # Read once: the library walks every added token on each call (0.6 ms with 29k of them, paid per
        # prompt id by is_valid_id).
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        # Prompt ids are bounded as vLLM bounds them: the tokenizer's highest id (its added tokens may lie
        # above its base vocabulary, with gaps) and the model's embedding rows (config.json vocab_size).
        self.max_token_id: int = max([self._tok.get_vocab_size(with_added_tokens=False) - 1, *added])
        self.num_embeddings: int | None = _embedding_rows(path)
        self.id_limit: int = min(self.max_token_id + 1, self.num_embeddings or self.max_token_id + 1)
        self._special_ids = frozenset(i for i, t in added.items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level BPE shows a leading space as "Ġ", as transformers'
        convert_ids_to_tokens does)."""
        return [self._tok.id_to_token(t) for t in token_ids]

    def is_valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self.id_limit

    def id_range_error(self, token_id: int) -> str:
        """Why ``token_id`` is refused, naming both bounds."""
        embedding = f"; the model's embedding has {self.num_embeddings} rows" if self.num_embeddings else ""
        return (
            f"token id {token_id} is out of range [0, {self.id_limit}): the tokenizer's highest id is "
            f"{self.max_token_id}{embedding}"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **template_kwargs,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, for templates that show them to the model;
        ``template_kwargs``: more variables, such as Qwen3's ``enable_thinking``); special tokens in
        the result are encoded as such. ``continue_final_message``: the text ends where the final
        message's content does (what the template closes it with is cut), as in transformers."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        # like transformers: None-valued keys are dropped (templates handle a missing key better)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if continue_final_message:
            messages[-1] = {**messages[-1], "content": (messages[-1].get("content") or "") + _CONTINUE_TAG}
        try:
            text = self._template.render(
                **{**self.special_tokens, **template_kwargs},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        return _cut_at_tag(text) if continue_final_message else text
