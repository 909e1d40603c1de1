"""msgpack codec for typed wire records. Nothing on any socket is unpickled.

A wire record is a ``slots`` dataclass registered under a short type tag::

    @wire_record("kv.commit")
    @dataclass(slots=True)
    class Commit:
        rid: str
        first_token: int | None = None

On the wire a record is ``[tag, {field: value}]``; nested records use the same shape. ``decode``
checks the size first, then every field against the dataclass annotation (int, float, str, bool,
bytes, list[T], T | None, nested records), and rejects unknown tags and missing or extra fields.
Every rejection is a ``WireError``, so a server catches one exception type per frame and keeps going.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack

DEFAULT_MAX_BYTES = 1 << 20  # control messages are small; data frames travel as raw bytes beside them


class WireError(ValueError):
    """A frame that is not a valid record: malformed, oversized, unknown or wrongly typed."""


_TAG_TO_CLASS: dict[str, type] = {}
_CLASS_TO_TAG: dict[type, str] = {}
_HINTS: dict[type, dict[str, Any]] = {}


def wire_record(tag: str):
    """Class decorator: register a slots dataclass under ``tag`` (unique across the project)."""

    def register(cls: type) -> type:
        assert dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__"), f"{cls} must be a slots dataclass"
        assert tag not in _TAG_TO_CLASS, f"wire tag {tag!r} registered twice"
        _TAG_TO_CLASS[tag] = cls
        _CLASS_TO_TAG[cls] = tag
        return cls

    return register


def encode(record: Any) -> bytes:
    return msgpack.packb(_to_wire(record), use_bin_type=True)


def decode(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES, expected: type | None = None) -> Any:
    """Bytes -> record. ``expected`` (optional) also rejects a valid record of another type."""
    if len(data) > max_bytes:
        raise WireError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise WireError(f"not msgpack: {type(exc).__name__}") from None
    record = _from_wire(raw, "record")
    if expected is not None and not isinstance(record, expected):
        raise WireError(f"expected {expected.__name__}, got {type(record).__name__}")
    return record


def _to_wire(value: Any) -> Any:
    tag = _CLASS_TO_TAG.get(type(value))
    if tag is not None:
        return [tag, {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _from_wire(raw: Any, where: str) -> Any:
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str) and isinstance(raw[1], dict)):
        raise WireError(f"{where}: expected [tag, fields]")
    tag, fields = raw
    cls = _TAG_TO_CLASS.get(tag)
    if cls is None:
        raise WireError(f"{where}: unknown record tag {tag[:64]!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(fields) - names
    if extra:
        raise WireError(f"{tag}: unexpected field(s) {sorted(extra)[:8]}")
    missing = sorted(n for n in names if n not in fields)
    if missing:
        raise WireError(f"{tag}: missing field(s) {missing[:8]}")
    values = {name: _check(value, hints[name], f"{tag}.{name}") for name, value in fields.items()}
    try:
        return cls(**values)
    except (AssertionError, ValueError, TypeError) as exc:  # __post_init__ invariants
        raise WireError(f"{tag}: invalid record: {str(exc)[:200]}") from None


def _check(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` converted to ``hint``'s type, or raise WireError naming the field."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(value, option, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: no type of {hint} matches")
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if hint in _CLASS_TO_TAG:
        tag = value[0] if isinstance(value, list) and value else None
        if tag != _CLASS_TO_TAG[hint]:  # checked first, so the error names this field
            raise WireError(f"{where}: expected a {_CLASS_TO_TAG[hint]} record, got {str(tag)[:64]!r}")
        return _from_wire(value, where)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint in (str, bytes):
        ok = isinstance(value, hint)
    else:
        raise WireError(f"{where}: unsupported annotation {hint}")
    if not ok:
        raise WireError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
    return value
