"""Builds a PdserveConfig from layered sources; later wins:

    1. defaults (configs/schema.py)
    2. YAML file: {section: {field: value}}
    3. environment: PDSERVE_<SECTION>_<FIELD>=value (strings, coerced to the field's type), and
       PDSERVE_API_KEY, one more accepted key; other PDSERVE_* variables are ignored with a warning
       (configs/environment.py: Kubernetes service links share the prefix)
    4. overrides (the CLI): {"section.field": value}; strings are coerced like env values

Every key from YAML and the overrides is checked against the schema as it is read, so a typo fails at
once with the key named (and a "did you mean"); values are coerced per field type, then choices and bounds are checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping

import yaml

from configs.environment import env_settings
from configs.schema import ConfigError, PdserveConfig


def load_config(
    yaml_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = os.environ,
    overrides: Mapping[str, object] | None = None,
) -> PdserveConfig:
    config = PdserveConfig()
    if yaml_path is not None:
        _apply_yaml(config, yaml_path)
    settings, api_keys = env_settings(env or {})
    for setting in settings:
        _set(config, setting.dotted, setting.raw, setting.source, from_text=True)
    config.gateway.api_keys += [key for key in api_keys if key not in config.gateway.api_keys]
    for dotted, value in (overrides or {}).items():
        _set(config, dotted, value, "override", from_text=isinstance(value, str))
    _check_bounds(config)
    return config


def _apply_yaml(config: PdserveConfig, path) -> None:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    source = f"YAML {os.fspath(path)}"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        _section(config, str(section), source)  # names an unknown section before its contents
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of fields, got {values!r} ({source})")
        for key, value in values.items():
            _set(config, f"{section}.{key}", value, source, from_text=False)


def _section(config: PdserveConfig, name: str, source: str):
    sections = [f.name for f in dataclasses.fields(config)]
    if name not in sections:
        raise ConfigError(f"unknown config section {name!r} ({source}){_did_you_mean(name, sections)}")
    return getattr(config, name)


def _set(config: PdserveConfig, dotted: str, value: object, source: str, *, from_text: bool) -> None:
    section_name, _, key = dotted.partition(".")
    section = _section(config, section_name, source)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown config key {dotted!r} ({source}){_did_you_mean(key, list(fields))}")
    hint = typing.get_type_hints(type(section))[key]
    try:
        coerced = _from_text(value, hint) if from_text else _check_type(value, hint)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{dotted}: bad value {value!r} ({source}): {e}") from None
    setattr(section, key, coerced)


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _split_optional(hint) -> tuple[object, bool]:
    """(the inner type, whether None is allowed) for ``T | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _from_text(text: str, hint) -> object:
    """Coerces an env/CLI string: bools as true/false/1/0/yes/no/on/off, lists comma-separated."""
    inner, optional = _split_optional(hint)
    stripped = text.strip()
    if optional and stripped.lower() in ("", "none", "null"):
        return None
    if inner is bool:
        if stripped.lower() in _TRUE | _FALSE:
            return stripped.lower() in _TRUE
        raise ValueError("expected a boolean (true/false, 1/0, yes/no, on/off)")
    if inner is int:
        return int(stripped)
    if inner is float:
        return float(stripped)
    if typing.get_origin(inner) is list:
        return [part.strip() for part in stripped.split(",") if part.strip()]
    return text


def _check_type(value: object, hint) -> object:
    """Checks a YAML/programmatic value; an int is accepted where a float is expected."""
    inner, optional = _split_optional(hint)
    if value is None:
        if optional:
            return None
        raise TypeError("this key cannot be null")
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if inner is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if inner is str and isinstance(value, str):
        return value
    if typing.get_origin(inner) is list:
        if isinstance(value, str):
            return _from_text(value, inner)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError("expected a list of strings")
    raise TypeError(f"expected {getattr(inner, '__name__', inner)}, got {type(value).__name__}")


def _check_bounds(config: PdserveConfig) -> None:
    for section_field in dataclasses.fields(config):
        section = getattr(config, section_field.name)
        for f in dataclasses.fields(section):
            value, dotted = getattr(section, f.name), f"{section_field.name}.{f.name}"
            choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
            if choices and value not in choices:
                raise ConfigError(f"{dotted}: must be one of {', '.join(choices)}; got {value!r}")
            if minimum is not None and value is not None and value < minimum:
                raise ConfigError(f"{dotted}: must be >= {minimum}; got {value!r}")
