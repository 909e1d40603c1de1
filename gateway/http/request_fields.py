"""Typed reads of a JSON request body, each with vLLM's accepted range; a bad value is a 400 naming it."""

from __future__ import annotations

import math
from typing import Any

from .errors import bad_request

_MISSING = object()
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT64_DIGITS = len(str(_INT64_MAX))  # 19: a longer key is refused before int() (which raises past 4300 digits)
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer holds back that much text while it matches
MAX_LOGIT_BIAS_KEYS = 1024  # far above any real use; bounds the per-request table the sampler builds


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not the integer 1


def _is_number(v: Any) -> bool:
    # Python's json accepts NaN and Infinity, which slip through every range comparison
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Fields:
    """Reads fields of one JSON object; unknown fields are ignored, as OpenAI and vLLM do."""

    __slots__ = ("_body",)

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        self._body = body

    def raw(self, name: str, default: Any = None) -> Any:
        value = self._body.get(name, _MISSING)
        return default if value is _MISSING or value is None else value

    def has(self, name: str) -> bool:
        return self._body.get(name) is not None

    def int(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.raw(name, default)
        if v is None:
            return None
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"{name} must be an integer{_range(lo, hi)}, got {_show(v)}", name)
        if not _INT64_MIN <= v <= _INT64_MAX:  # msgpack (the wire to workers) and torch stop at 64 bits
            raise bad_request(f"{name} must be a 64-bit integer, got {_show(v)}", name)
        return v

    def float(
        self, name: str, default: float, lo: float | None = None, hi: float | None = None, lo_open: bool = False
    ) -> float:
        v = self.raw(name, default)
        bad = not _is_number(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi)
        if bad:
            rng = f" in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f" {'>' if lo_open else '>='} {lo}"
            raise bad_request(f"{name} must be a number{rng}, got {_show(v)}", name)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.raw(name, default)
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be a boolean, got {_show(v)}", name)
        return v

    def str(self, name: str, default: str | None) -> str | None:
        v = self.raw(name, default)
        if v is not None and not isinstance(v, str):
            raise bad_request(f"{name} must be a string, got {_show(v)}", name)
        return v

    def stop_strings(self, name: str = "stop", max_count: int = 4) -> list[str]:
        v = self.raw(name, [])
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > max_count:
            raise bad_request(f"{name} must be a string or a list of at most {max_count} strings", name)
        if any(s == "" for s in v):
            raise bad_request(f"{name} must not contain an empty string", name)
        longest = max((len(s) for s in v), default=0)
        if longest > MAX_STOP_CHARS:
            raise bad_request(f"{name} strings may have at most {MAX_STOP_CHARS} characters, got {longest}", name)
        return v

    def token_ids(self, name: str) -> list[int]:
        v = self.raw(name, [])
        if not isinstance(v, list) or not all(_is_int(t) and 0 <= t <= _INT64_MAX for t in v):
            raise bad_request(f"{name} must be a list of non-negative integers", name)
        return v

    def logit_bias(self, name: str, max_bias: float) -> dict[int, float]:
        """OpenAI's map of token ids (JSON object keys, so strings of digits) to a bias in [-max_bias, max_bias]."""
        v = self.raw(name, {})
        if not isinstance(v, dict):
            raise bad_request(f"{name} must be an object mapping token ids to numbers, got {_show(v)}", name)
        if len(v) > MAX_LOGIT_BIAS_KEYS:
            raise bad_request(f"{name} may bias at most {MAX_LOGIT_BIAS_KEYS} tokens, got {len(v)}", name)
        out = {}
        for key, bias in v.items():
            short = len(key) <= _INT64_DIGITS
            if not (short and key.isascii() and key.isdigit() and int(key) <= _INT64_MAX):
                raise bad_request(f"{name} keys must be token ids (non-negative integers), got {_show(key)}", name)
            if not _is_number(bias) or abs(bias) > max_bias:
                raise bad_request(
                    f"{name}[{key[:20]}] must be a number in [-{max_bias:g}, {max_bias:g}], got {_show(bias)}", name
                )
            out[int(key)] = float(bias)
        return out

    def object(self, name: str) -> Fields | None:
        v = self.raw(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise bad_request(f"{name} must be an object, got {_show(v)}", name)
        return Fields(v)


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else ""


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
