"""What the serving benchmark runs: the systems under test and, per mode, the workload sizes and loads.

Systems (each its own ``pdserve serve``, the same cores):
- disagg: 1 prefill + 1 decode worker, one core each (``pdserve serve`` gives each worker
  cores // workers threads).
- coloc: ``--prefill 0 --decode 1``: the decode worker prefills locally on all the cores.
- nocache: disagg with ``engine.enable_prefix_caching=false``.
- disagg-int8: disagg with ``--kv-cache-dtype int8`` (the streams workload: TTFT and ITL at 16 and 32
  streams beside disagg's), selected with ``--systems disagg,disagg-int8``.
- llama: llama.cpp's ``llama-server`` (benchmarks/peers/llama_server.py) on the same cores and the GGUF f32
  of the same model, after its greedy output was checked: the streams workload at ``--parallel N``
  for N streams, the others on one server of LLAMA_CONFIG (benchmarks.serve.run_llama).
- coloc-q8, llama-q8, coloc-q4, llama-q4, coloc-q4km, llama-q4km, coloc-bf16, llama-bf16, coloc-f16,
  llama-f16: pdserve and llama-server on the same SmolLM2 GGUF file at the same bits, streams at 1 and
  16 (benchmarks/serve/gguf_systems.py); coloc-q8-int16, coloc-q4-int16: coloc-q8/q4 with
  ``model.quant_activations: int16``, run only where ``--systems`` names them.
- coloc-spec, coloc-nospec, llama-spec: speculative decoding on and off, and llama-server's own, on the
  copying and free-generation chat workloads at 1, 4 and 16 streams (benchmarks/serve/spec_systems.py).
The transformers static-batching baseline runs offline on the same mixed requests as the closed loops
(64), same cores, at batch 16 (the headline's, four full batches) and at HF_BATCH_SIZES, whose best
is the strongest static batching this machine gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import yaml

from benchmarks.peers.llama_server import LlamaConfig
from benchmarks.serve.gguf_systems import GGUF_FORMATS, GGUF_STREAMS, INT16_FORMATS, gguf_system_names
from benchmarks.serve.spec_systems import LLAMA_SPEC_FLAGS, SPEC_STREAMS, spec_engine_section

STATIC_BATCH_SIZE = 16
HF_BATCH_SIZES = (16, 32, 64)
WORKLOADS = ("mixed_rates", "mixed_closed", "prefix", "interference", "streams")
ALL_WORKLOADS = (*WORKLOADS, "spec")  # "spec": only the speculative decoding systems run it (spec_systems)
# The streams workload (the shape of issue #36's comparison with llama-server, measured there with
# GuideLLM): every request 256 prompt tokens and 128 output tokens, a closed loop at each concurrency.
STREAM_CONCURRENCIES = (1, 16, 32)
STREAM_PROMPT_LEN = 256
STREAM_OUTPUT_LEN = 128
# llama-server's slots must hold the longest request any workload sends (interference: 2048 + 8) and
# as many requests as any workload has in flight (mixed, all at once: 64). threads=0: one per core.
# The streams workload runs each concurrency N on a server of its own with --parallel N (issue #36's
# configuration). The sweep of threads, --parallel and flash attention: docs/benchmarks.md.
LLAMA_CONFIG = LlamaConfig(threads=0, parallel=64, flash_attn=False, ctx_per_slot=4096)


@dataclass(slots=True, frozen=True)
class SystemSpec:
    name: str
    num_prefill: int
    num_decode: int
    sections: dict  # YAML config sections given to pdserve serve
    workloads: tuple[str, ...]  # which of WORKLOADS it runs
    llama: LlamaConfig | None = None  # set: llama-server with this configuration instead of pdserve
    gguf: str = ""  # a SmolLM2 GGUF format (benchmarks/peers/gguf_variants.py) served instead of the model
    stream_levels: tuple[int, ...] = STREAM_CONCURRENCIES  # the streams workload's concurrencies
    opt_in: bool = False  # runs only where --systems names it (a variant's cost, not a headline's run)


@dataclass(slots=True, frozen=True)
class Plan:
    closed_requests: int  # mixed requests in the closed-loop runs and the offline transformers baseline
    concurrency: int  # the first closed loop: requests in flight, the baseline's batch size
    rate_requests: int  # mixed requests per Poisson rate
    rates_rps: tuple[float, ...]  # Poisson rates for latency vs load
    prefix_requests: int
    prefix_rate_rps: float
    short_requests: int  # interference: short decode-heavy requests
    short_rate_rps: float
    num_bursts: int
    burst_size: int  # 2048-token prompts per burst
    systems: tuple[SystemSpec, ...] = field(default=())
    stream_rounds: int = 2  # streams: requests per concurrency c = stream_rounds * c ...
    stream_min_requests: int = 8  # ... and at least this many (one stream needs several for its ITL/TTFT)


def _sections(prefix_caching: bool = True, kv_cache_dtype: str = "auto", quant_activations: str = "int8") -> dict:
    # Long enough for 2048-token prompts; pools sized so no workload preempts.
    engine = {"enable_prefix_caching": prefix_caching, "max_num_seqs": 64, "kv_cache_memory_mb": 1024}
    if kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = kv_cache_dtype
    model = {"max_model_len": 4096}
    if quant_activations != "int8":
        model["quant_activations"] = quant_activations
    return {"model": model, "engine": engine}


def systems(quick: bool) -> tuple[SystemSpec, ...]:
    return (
        SystemSpec("disagg", 1, 1, _sections(), WORKLOADS),
        SystemSpec(
            "coloc",
            0,
            1,
            _sections(),
            WORKLOADS if not quick else ("mixed_rates", "mixed_closed", "interference", "streams"),
        ),
        SystemSpec(
            "nocache",
            1,
            1,
            _sections(prefix_caching=False),
            ("mixed_closed", "prefix") + (() if quick else ("mixed_rates",)),
        ),
        # --quick: the runs of the headlines that name llama-server (equal concurrency) only.
        SystemSpec("llama", 0, 0, {}, WORKLOADS if not quick else ("mixed_closed", "streams"), LLAMA_CONFIG),
        SystemSpec("disagg-int8", 1, 1, _sections(kv_cache_dtype="int8"), ("streams",)),
        *gguf_systems(),
        *spec_systems(),
    )


def spec_systems() -> tuple[SystemSpec, ...]:
    """Speculative decoding on and off in pdserve, and llama-server's own (benchmarks/serve/spec_systems.py)."""
    on = _sections()
    on["engine"] = {**on["engine"], **spec_engine_section()}
    llama = replace(LLAMA_CONFIG, extra=LLAMA_SPEC_FLAGS)
    return (
        SystemSpec("coloc-spec", 0, 1, on, ("spec",), stream_levels=SPEC_STREAMS),
        SystemSpec("coloc-nospec", 0, 1, _sections(), ("spec",), stream_levels=SPEC_STREAMS),
        SystemSpec("llama-spec", 0, 0, {}, ("spec",), llama, stream_levels=SPEC_STREAMS),
    )


def gguf_systems() -> tuple[SystemSpec, ...]:
    """pdserve (colocated) and llama-server on the same GGUF file, per format of GGUF_FORMATS."""
    specs = []
    for tag, fmt in GGUF_FORMATS.items():
        ours, theirs = gguf_system_names(tag)
        specs.append(SystemSpec(ours, 0, 1, _sections(), ("streams",), gguf=fmt, stream_levels=GGUF_STREAMS))
        specs.append(SystemSpec(theirs, 0, 0, {}, ("streams",), LLAMA_CONFIG, gguf=fmt, stream_levels=GGUF_STREAMS))
    for tag in INT16_FORMATS:  # the same file with model.quant_activations int16: what the second term costs
        sections = _sections(quant_activations="int16")
        specs.append(
            SystemSpec(
                f"coloc-{tag}-int16",
                0,
                1,
                sections,
                ("streams",),
                gguf=GGUF_FORMATS[tag],
                stream_levels=GGUF_STREAMS,
                opt_in=True,
            )
        )
    return tuple(specs)


def plan(quick: bool) -> Plan:
    # The shared-prefix run's first request of each of its 4 prefixes finds nothing cached: with 16
    # requests those were a quarter of the sample, and its p50 fell among the cached ones' slowest
    # (2026-11-25, one run each way on the same seeds: 74 ms against 216 with 16 requests, 67 against
    # 208 with 32). 32 keep the quick run's cold share nearer the full run's 4 of 48.
    #
    # The interference target is a p99 over the short requests, and a p99 of n samples is their
    # (0.99 * (n - 1))-th order statistic (from 0): with 24 it was mostly the slowest request, so
    # the quick ratio moved 0.34-0.57 between runs of the same code (2026-11-25) while the full
    # run's 72 gave 0.30-0.32. With 108 it lies between the 2nd and 3rd slowest of the ~20 that the
    # quick run's six bursts slow down. Both modes keep one burst per 18 short requests (~12 s at
    # 1.5 rps). That is 56 s more per system, so the quick sweep keeps the full one's two faster
    # rates: at 0.5 rps its 12 requests took 22 s of the 537 a quick run took (2026-11-25), against
    # the 10-minute budget.
    if quick:
        return Plan(
            closed_requests=64,
            concurrency=STATIC_BATCH_SIZE,
            rate_requests=12,
            rates_rps=(1.0, 2.0),
            prefix_requests=32,
            prefix_rate_rps=1.0,
            short_requests=108,
            short_rate_rps=1.5,
            num_bursts=6,
            burst_size=2,
            systems=systems(True),
            stream_rounds=2,
        )
    return Plan(
        closed_requests=64,
        concurrency=STATIC_BATCH_SIZE,
        rate_requests=32,
        rates_rps=(0.25, 0.5, 1.0, 2.0),
        prefix_requests=48,
        prefix_rate_rps=0.5,
        short_requests=144,
        short_rate_rps=1.5,
        num_bursts=8,
        burst_size=2,
        systems=systems(False),
        stream_rounds=4,
        stream_min_requests=16,
    )


def with_insecure_twins(p: Plan) -> Plan:
    """Each system, then the same system with ``transfer.insecure`` (plain TCP on the worker plane), so
    the cost of CurveZMQ is measured side by side in one run (docs/security.md)."""
    twins = []
    for spec in p.systems:
        if spec.llama is not None:  # not pdserve: no worker plane to encrypt
            twins.append(spec)
            continue
        sections = {**spec.sections, "transfer": {**spec.sections.get("transfer", {}), "insecure": True}}
        twins += [spec, replace(spec, name=f"{spec.name}-insecure", sections=sections)]
    return replace(p, systems=tuple(twins))


def select(
    p: Plan, systems: list[str] | None = None, workloads: list[str] | None = None, overrides: list[str] = ()
) -> Plan:
    """``p`` narrowed to some systems and workloads (each system keeps only those of its own it is
    asked for), with ``SECTION.KEY=VALUE`` config overrides (VALUE read as YAML) on every system:
    for A/B runs of one setting on one workload. Raises ValueError naming a wrong name or override."""
    known = [s.name for s in p.systems]
    for name, given, valid in (("system", systems, known), ("workload", workloads, ALL_WORKLOADS)):
        wrong = [x for x in given or () if x not in valid]
        if wrong:
            raise ValueError(f"unknown {name}(s) {wrong}; choose from {list(valid)}")
    changes: dict[str, dict] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, field_name = key.partition(".")
        if not (sep and dot and section and field_name):
            raise ValueError(f"override {item!r} is not SECTION.KEY=VALUE")
        changes.setdefault(section, {})[field_name] = yaml.safe_load(value)
    chosen = []
    for spec in p.systems:
        if (systems and spec.name not in systems) or (not systems and spec.opt_in):
            continue
        names = tuple(w for w in spec.workloads if not workloads or w in workloads)
        sections = {k: {**spec.sections.get(k, {}), **changes.get(k, {})} for k in {*spec.sections, *changes}}
        chosen.append(replace(spec, workloads=names, sections=sections))
    return replace(p, systems=tuple(chosen))
