"""Which ``PDSERVE_*`` environment variables are config, and which only share the prefix.

A pdserve process does not own its environment. Kubernetes injects service-link variables for every
Service in the namespace (a Service ``pdserve-gateway`` gives ``PDSERVE_GATEWAY_SERVICE_HOST``,
``PDSERVE_GATEWAY_PORT=tcp://10.96.0.10:8000``, ``PDSERVE_GATEWAY_PORT_8000_TCP_ADDR`` ...); operators
export ``PDSERVE_API_KEY`` for ``pdserve status``; the kernel caches read their own variables. None of
these may stop a process, so only a variable that names a field (``PDSERVE_<SECTION>_<FIELD>``) is config:

- a field's variable is applied, and a bad value for it is still an error (the operator set it);
- one whose value is a service link (``tcp://host:port``) for a field that is not a string is the
  Kubernetes variable that happens to share the name (``PDSERVE_GATEWAY_PORT``): ignored, with a warning;
- ``PDSERVE_API_KEY`` adds one accepted key to ``gateway.api_keys`` (as ``VLLM_API_KEY`` does for vLLM);
- any other is ignored: service-link shapes with one info line, the rest with a warning naming it
  (and the nearest field's variable, for a typo).

Each warning is logged once per process: the supervisor loads the config again at every child start.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from configs.schema import PdserveConfig

log = logging.getLogger(__name__)

ENV_PREFIX = "PDSERVE_"
API_KEY_ENV = "PDSERVE_API_KEY"
# Read where they act, not config: the C kernels' build cache (kernels/cpu/native.py) and the CPU
# matmul forms' cache (kernels/cpu/forms_cache.py).
PROCESS_ENV = frozenset({"PDSERVE_NATIVE_CACHE_DIR", "PDSERVE_CPU_FORMS_CACHE_DIR", "PDSERVE_RETIME_CPU_FORMS"})

# Kubernetes' service-link variables (Docker links' naming): <SVC>_SERVICE_HOST, <SVC>_SERVICE_PORT,
# <SVC>_SERVICE_PORT_<NAME>, <SVC>_PORT, <SVC>_PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR]. <SVC>_PORT alone
# is recognised by its value, as it may coincide with a field's variable.
_LINK_NAME = re.compile(r"_SERVICE_(HOST|PORT)(_\w+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?$")
_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class EnvSetting:
    dotted: str  # "section.field"
    raw: str  # the variable's text, coerced by the loader like a --set value
    source: str  # "env PDSERVE_..." for error messages


def env_settings(env: Mapping[str, str]) -> tuple[list[EnvSetting], list[str]]:
    """(the config settings in ``env``, in name order; the API keys ``PDSERVE_API_KEY`` adds)."""
    settings, links = [], []
    fields = _field_types()
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in PROCESS_ENV or name == API_KEY_ENV:
            continue
        dotted = _dotted(name)
        if dotted in fields:
            if not _is_text(fields[dotted]) and _LINK_VALUE.match(raw.strip()):
                _warn_once(
                    f"{name}={raw!r} looks like a Kubernetes service link, not a value for {dotted}; "
                    f"ignored (enableServiceLinks: false in the pod spec removes these variables)"
                )
            else:
                settings.append(EnvSetting(dotted, raw, f"env {name}"))
        elif _LINK_NAME.search(name) or _LINK_VALUE.match(raw.strip()):
            links.append(name)
        else:
            close = difflib.get_close_matches(name, [_env_name(d) for d in fields], n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            _warn_once(f"{name} is not a pdserve config variable (PDSERVE_<SECTION>_<FIELD>); ignored{hint}")
    if links:
        _info_once(f"ignored {len(links)} Kubernetes service-link variable(s): {', '.join(links)}")
    key = env.get(API_KEY_ENV, "").strip()
    return settings, [key] if key else []


def _dotted(name: str) -> str:
    section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
    return f"{section}.{key}"


def _env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


@functools.cache
def _field_types() -> dict[str, object]:
    """{"section.field": the field's type hint} for every field of the schema."""
    config = PdserveConfig()
    return {
        f"{section.name}.{name}": hint
        for section in dataclasses.fields(config)
        for name, hint in typing.get_type_hints(type(getattr(config, section.name))).items()
    }


def _is_text(hint) -> bool:
    return hint is str or str in typing.get_args(hint) and typing.get_origin(hint) is not list


@functools.cache  # once per process and message: the supervisor loads the config at every child start
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.cache
def _info_once(message: str) -> None:
    log.info(message)
