"""vLLM's command-line names for the settings pdserve has, grouped as ``vllm serve --help`` groups them.

Each flag is a view of one config field (configs/schema.py): parsing yields ``{"section.field": text}``
overrides, the same shape ``--set`` gives, so every source keeps one precedence (CLI > env > YAML >
defaults) and one validation (configs/loader.py). Flags for what pdserve does not do (tensor
parallelism, a device-memory fraction) are refused with what to use instead, not ignored.

``pdserve serve`` and ``pdserve gateway|prefill|decode`` add these groups; the pdserve-only options
(pool sizes, ``--config``, ``--set``) stay in their own group, so a vLLM command line works as given.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

from configs.schema import ConfigError, PdserveConfig

_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings of the same dtypes
_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_size(text: str) -> int:
    """A byte count as vLLM writes one: ``8589934592``, ``8G`` (10^9), ``8GiB`` or ``8Gi`` (2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size in bytes (e.g. 2147483648, 2G, 2GiB), got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def parse_token_count(text: str) -> int:
    """vLLM's --max-model-len form: ``4096``, ``4k`` (4000) or ``4K`` (4096)."""
    match = re.fullmatch(r"\s*(\d+)([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count (e.g. 4096, 4k, 4K), got {text!r}")
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20}[match.group(2)]
    return int(match.group(1)) * scale


@dataclass(frozen=True, slots=True)
class Flag:
    names: tuple[str, ...]  # first is the canonical vLLM spelling; the rest are aliases
    key: str  # config field it sets; "{role}" stands for the worker's section
    help: str
    type: object = str  # argparse type; None: an on/off flag (--x / --no-x); "list": one or more values
    metavar: str | None = None


GROUPS: dict[str, tuple[Flag, ...]] = {
    "ModelConfig": (
        Flag(
            ("--served-model-name",),
            "model.served_model_name",
            "the name clients put in 'model' (one; vLLM takes several)",
            "list",
        ),
        Flag(
            ("--max-model-len",),
            "model.max_model_len",
            "context length in tokens (e.g. 4096, 4k, 4K); longer prompts are a 400",
            parse_token_count,
        ),
        Flag(("--dtype",), "model.dtype", "weights and KV dtype: auto, float32 (float), bfloat16, float16 (half)"),
        Flag(
            ("--load-format",),
            "model.load_format",
            "auto: the checkpoint's safetensors; dummy: random weights on the device from config.json alone",
        ),
        Flag(
            ("--quantization", "-q"),
            "model.quantization",
            "int8: per-channel weight-only int8 made at load (CPU); a GGUF file keeps its own formats",
        ),
        Flag(("--seed",), "engine.seed", "seed of the sampler shared by unseeded requests", int),
    ),
    "CacheConfig": (
        Flag(("--block-size",), "engine.block_size", "tokens per KV block (prefill and decode must agree)", int),
        Flag(("--enable-prefix-caching",), "engine.enable_prefix_caching", "reuse cached KV of shared prefixes", None),
        Flag(
            ("--kv-cache-memory-bytes", "--kv-cache-memory"),
            "engine.kv_cache_memory_mb",
            "each worker's KV pool size in bytes (e.g. 2G, 2GiB); stored rounded down to MiB",
            parse_size,
            "BYTES",
        ),
        Flag(("--num-gpu-blocks-override",), "engine.num_kv_blocks", "exact KV pool size in blocks", int),
        Flag(
            ("--kv-cache-dtype",),
            "engine.kv_cache_dtype",
            "what the KV pool stores: auto (the model's dtype), int8 (per-token-per-head scales), fp8 (GPU)",
        ),
    ),
    "SchedulerConfig": (
        Flag(("--max-num-seqs",), "engine.max_num_seqs", "sequences in one decode batch at most", int),
        Flag(("--max-num-batched-tokens",), "engine.max_num_batched_tokens", "tokens computed in one step", int),
        Flag(
            ("--long-prefill-token-threshold",),
            "engine.prefill_chunk_size",
            "prompt tokens one request may compute per step (pdserve's prefill chunk)",
            int,
        ),
    ),
    "LoRAConfig": (  # config section lora (engine/lora/manager.py)
        Flag(("--enable-lora",), "lora.enable_lora", "serve LoRA adapters; a request names one as its model", None),
        Flag(
            ("--lora-modules",),
            "lora.lora_modules",
            "adapters served from the start, NAME=PATH (PEFT directories, the same path on every worker)",
            "list",
            "NAME=PATH",
        ),
        Flag(("--max-loras",), "lora.max_loras", "adapters in a worker's device slots at once", int),
        Flag(("--max-lora-rank",), "lora.max_lora_rank", "highest adapter rank accepted", int),
        Flag(("--max-cpu-loras",), "lora.max_cpu_loras", "adapters kept in a worker's host memory", int),
    ),
    "SpeculativeConfig": (  # engine/spec/config.py parses the JSON; the decode worker speculates
        Flag(
            ("--speculative-config",),
            "engine.speculative_config",
            'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4}\'',
            str,
            "JSON",
        ),
    ),
    "ObservabilityConfig": (
        Flag(
            ("--otlp-traces-endpoint",),
            "observability.otlp_traces_endpoint",
            "OTLP traces endpoint, e.g. http://collector:4318/v1/traces, or http://collector:4317 with "
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc (off when unset)",
        ),
        Flag(("--log-level",), "observability.log_level", "debug, info, warning, error or critical"),
        Flag(("--log-format",), "observability.log_format", "text, or json: one object per line"),
    ),
}

# The HTTP front door: the gateway's (``pdserve serve`` and ``pdserve gateway``) ...
FRONTEND = (
    Flag(("--host",), "gateway.host", "interface the HTTP API binds"),
    Flag(("--port",), "gateway.port", "HTTP port of the API", int),
    Flag(("--api-key",), "gateway.api_keys", "accepted bearer key(s) (several, or repeat the flag)", "list"),
    Flag(("--chat-template",), "model.chat_template", "chat template: a Jinja file, or the template itself"),
    Flag(("--reasoning-parser",), "gateway.reasoning_parser", "split <think> reasoning into the reasoning field"),
    Flag(("--tool-call-parser",), "gateway.tool_call_parser", "read the model's own tool calls (tool_choice auto)"),
    Flag(("--allowed-origins",), "gateway.allowed_origins", "origins whose pages may call the API (CORS)", "list"),
)


def worker_frontend(role: str) -> tuple[Flag, ...]:
    """... and a worker's: its bind interface and its HTTP port (/metrics, /health, /ready)."""
    return (
        Flag(("--host",), f"{role}.host", "interface the worker binds (and advertises)"),
        Flag(("--port",), f"{role}.http_port", "HTTP port of /metrics, /health and /ready", int),
    )


# Flags vLLM has and pdserve refuses (a value it honours is accepted): flag -> (accepted, what to do instead)
REFUSED: dict[str, tuple[str | None, str]] = {
    "--tensor-parallel-size": (
        "1",
        "pdserve runs each worker on one device; add workers (--prefill N, --decode N) to use more devices",
    ),
    "--pipeline-parallel-size": (
        "1",
        "pdserve runs each worker on one device; add workers (--prefill N, --decode N) to use more devices",
    ),
    "--gpu-memory-utilization": (None, "pdserve sizes each worker's KV pool in bytes: use --kv-cache-memory-bytes"),
}
_REFUSED_ALIASES = {"--tensor-parallel-size": ("-tp",), "--pipeline-parallel-size": ("-pp",)}


def _dest(flag: Flag) -> str:
    return "vllm_" + flag.names[0].lstrip("-").replace("-", "_")


def flags_for(role: str) -> dict[str, tuple[Flag, ...]]:
    """Every group of vLLM flags ``role`` takes ("gateway" for ``pdserve serve`` too)."""
    return {**GROUPS, "Frontend": FRONTEND if role == "gateway" else worker_frontend(role)}


def add_vllm_groups(parser: argparse.ArgumentParser, role: str) -> None:
    """The ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ObservabilityConfig and Frontend
    groups, each flag's help naming the config field it sets."""
    for title, flags in flags_for(role).items():
        group = _add_group(parser, title, flags)
        if title == "CacheConfig":
            _add_refused(group, "--gpu-memory-utilization")
        if title == "SchedulerConfig":
            parallel = parser.add_argument_group("ParallelConfig")
            _add_refused(parallel, "--tensor-parallel-size")
            _add_refused(parallel, "--pipeline-parallel-size")


def _add_group(parser: argparse.ArgumentParser, title: str, flags: tuple[Flag, ...]):
    group = parser.add_argument_group(title)
    for flag in flags:
        group.add_argument(
            *flag.names,
            dest=_dest(flag),
            default=None,
            help=f"{flag.help} ({flag.key})",
            metavar=flag.metavar or _metavar(flag.names[0]),
            **_kind(flag),
        )
    return group


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """The LoRAConfig group alone (``pdserve generate``, whose other flags are sampling's)."""
    _add_group(parser, "LoRAConfig", GROUPS["LoRAConfig"])


def lora_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config overrides of the LoRAConfig flags on ``args`` (added by ``add_lora_flags``)."""
    return {
        flag.key: _as_text(flag, value)
        for flag in GROUPS["LoRAConfig"]
        if (value := getattr(args, _dest(flag), None)) is not None
    }


def _metavar(name: str) -> str:
    return name.lstrip("-").upper().replace("-", "_")


def _schema_choices(key: str) -> tuple | None:
    """The field's allowed values from the schema (so --help lists them and argparse refuses others)."""
    section, _, name = key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(getattr(PdserveConfig(), section))}
    return fields[name].metadata.get("choices")


def _kind(flag: Flag) -> dict:
    choices = _schema_choices(flag.key)
    if choices:
        return {"choices": choices + (tuple(_DTYPE_ALIASES) if flag.key == "model.dtype" else ())}
    if flag.type is None:
        return {"action": argparse.BooleanOptionalAction}
    if flag.type == "list":  # `--api-key a b` and `--api-key a --api-key b` alike, as vLLM takes them
        return {"action": "extend", "nargs": "+"}
    return {"type": flag.type}


def _add_refused(group, name: str) -> None:
    accepted, instead = REFUSED[name]
    note = f"only {accepted}: " if accepted else "not supported: "
    group.add_argument(
        name,
        *_REFUSED_ALIASES.get(name, ()),
        dest="refused_" + name.lstrip("-").replace("-", "_"),
        default=None,
        metavar=_metavar(name),
        help=note + instead,
    )


def vllm_overrides(args: argparse.Namespace, role: str) -> dict[str, str]:
    """The config overrides the vLLM flags on ``args`` ask for; ConfigError for a refused flag."""
    for name, (accepted, instead) in REFUSED.items():
        value = getattr(args, "refused_" + name.lstrip("-").replace("-", "_"), None)
        if value is not None and value != accepted:
            raise ConfigError(f"{name} {value}: {instead}")
    overrides = {}
    for flags in flags_for(role).values():
        for flag in flags:
            value = getattr(args, _dest(flag), None)
            if value is not None:
                overrides[flag.key] = _as_text(flag, value)
    return overrides


def _as_text(flag: Flag, value) -> str:
    if flag.key == "engine.kv_cache_memory_mb":
        if value < 1 << 20:
            raise ConfigError(f"{flag.names[0]} {value}: the KV pool needs at least 1 MiB (1048576 bytes)")
        return str(value >> 20)
    if flag.key == "model.dtype":
        return _DTYPE_ALIASES.get(value, value)
    if flag.key == "model.served_model_name":
        if len(value) > 1:
            raise ConfigError(f"{flag.names[0]} {' '.join(value)}: pdserve serves one model under one name; give one")
        return value[0]
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
