"""Offline generation in one process: ``LLM(model).generate(prompts, params)``.

Builds the engine from the config's ``model`` and ``engine`` sections: loads the checkpoint, sizes the
KV pool from the memory budget, and wires block manager, scheduler, runner and sampler together.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Sequence as Seq

import torch

from configs.loader import load_config
from configs.model_source import resolve_model
from configs.schema import ConfigError, EngineConfig, LoRAConfig, ModelConfig, PdserveConfig
from engine.kv.block_manager import BlockManager
from engine.kv.cache_dtype import kv_storage_dtype
from engine.kv.pool import KVLayout, KVPool, num_blocks_for_budget
from engine.llm_engine import LLMEngine, RequestOutput
from engine.lora.adapter import LoRAError
from engine.lora.manager import LoRALimits, LoRAManager
from engine.model.cpu_linear import exclusive_timing
from engine.model.loader import load_model
from engine.quant.apply import quantize_at_load, quantized_modules, use_quant_activations
from engine.quant.forms import choose_quant_forms
from engine.quant.forms import describe as describe_quant_forms
from engine.quant.linear import int_up_to
from engine.sampling.grammar_compiles import GrammarLimits
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.structured_output import Grammars
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.spec.build import SpeculatorInputs, build_speculator
from engine.step.runner import ModelRunner, supports_native_decode
from kernels.cpu import native as cpu_native

log = logging.getLogger(__name__)

# A decode step of up to this many sequences runs its layers as one C call, every projection on the C
# linear whatever the load-time timing of single projections picked: the timing cannot see the per-call
# cost the fused step removes. 2-core Xeon, `small` model, ms per decode step (the timed forms, layer by
# layer -> the C linear, one call), 2026-11-27: 1 sequence 7.2-7.4 -> 5.0-5.2, 16: 15.3-15.8 -> 14.6-15.2,
# 32: 22.9-25.2 -> 22.5-25.3, 64: 48.5 -> 48.1. Past it (a prefill chunk) the timed forms stand. Quantized
# projections likewise take their int kernel (kernels/cpu/quant.c) up to it: the panel form dequantizes
# the whole weight per call, and the timing on a loaded 2-core EPYC once picked it for 1 row (then a
# Q8_0 decode step was 10x slower than f32's).
FUSED_DECODE_ROWS = 64

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(
    model_path: str,
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    device: str | None = None,
    lora_cfg: LoRAConfig | None = None,
) -> LLMEngine:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    dtype = DTYPES.get(model_cfg.dtype)  # None ("auto"): the loader picks by device
    started = time.monotonic()
    log.info(
        "loading model %s (dtype %s, %s, %d threads)", model_path, model_cfg.dtype, device, torch.get_num_threads()
    )
    model, config = load_model(model_path, dtype=dtype, device=device, load_format=model_cfg.load_format)
    _log_loaded(model, config, time.monotonic() - started)
    if model_cfg.quantization:
        quantize_at_load(model, model_cfg.quantization, device)
    if model_cfg.quant_activations != "int8":  # before the forms are timed: they time the kernels as called
        count = use_quant_activations(model, model_cfg.quant_activations)
        log.info("quantized projections' activations: %s (%d projections)", model_cfg.quant_activations, count)
    fused_decode_rows = 0  # decode steps of up to this many rows may run as one C call (engine/model/decode_step.py)
    if device == "cpu":  # after set_num_threads: which form wins depends on the thread count
        layer_ops = cpu_native.load() if engine_cfg.cpu_layer_ops == "c" else None
        if (
            layer_ops is not None
            and next(model.parameters()).dtype == torch.float32
            and not _one_thread_too_few(layer_ops)
        ):
            model.use_native_layer_ops(layer_ops)
        log.info("CPU norms, RoPE and SwiGLU: %s", "C" if model.native_layer_ops else "torch")
        native = cpu_native.load() if engine_cfg.cpu_decode_linear == "c" else None
        if native is not None and model.native_layer_ops and engine_cfg.cpu_decode_attention == "c":
            fused_decode_rows = FUSED_DECODE_ROWS
        with exclusive_timing():
            forms = model.choose_cpu_matmul_forms(native, fused_decode_rows)
        log.info("CPU matmul forms by weight: %s", ", ".join(f"{k} {f.describe()}" for k, f in forms.items()))
        if quantized_modules(model):
            with exclusive_timing():
                log.info(
                    "quantized matmul forms: %s", describe_quant_forms(choose_quant_forms(quantized_modules(model)))
                )
            if fused_decode_rows:  # as the C linear above: the fused step runs the int kernel at decode rows
                int_up_to(quantized_modules(model), fused_decode_rows)
                log.info("quantized projections: the int kernel up to %d rows (one C call per step)", fused_decode_rows)
    max_model_len = model_cfg.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's {config.max_position_embeddings} positions"
        )
    kv_dtype = next(model.parameters()).dtype
    store_dtype = kv_storage_dtype(engine_cfg.kv_cache_dtype, kv_dtype, device)
    probe = KVLayout(config.num_layers, 1, engine_cfg.block_size, config.num_kv_heads, config.head_dim, store_dtype)
    num_blocks = engine_cfg.num_kv_blocks or num_blocks_for_budget(
        engine_cfg.kv_cache_memory_mb << 20, probe.bytes_per_block
    )
    layout = KVLayout(
        config.num_layers, num_blocks, engine_cfg.block_size, config.num_kv_heads, config.head_dim, store_dtype
    )
    pool = KVPool(layout, device=device)
    log.info(
        "KV pool: %d blocks of %d tokens (%d tokens), %.0f MiB %s; engine ready in %.1f s, %s",
        num_blocks,
        engine_cfg.block_size,
        num_blocks * engine_cfg.block_size,
        num_blocks * layout.bytes_per_block / 2**20,
        layout.dtype,
        time.monotonic() - started,
        _memory(),
    )
    block_manager = BlockManager(
        num_blocks, engine_cfg.block_size, enable_prefix_caching=engine_cfg.enable_prefix_caching
    )
    sampler = Sampler(engine_cfg.seed)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            prefill_chunk_size=engine_cfg.prefill_chunk_size,
        ),
        block_manager,
        build_speculator(SpeculatorInputs(engine_cfg, model, config, num_blocks, sampler, device), _native_attention),
    )
    lora = _lora_manager(model, config, lora_cfg or LoRAConfig(), kv_dtype, device)
    native_decode = _native_attention("decode", engine_cfg.cpu_decode_attention, config, pool)
    # The fused step (decode_step.c) stores and reads float32 or int8 K/V, as the layers do.
    if native_decode is not None and fused_decode_rows:
        fused = model.use_fused_decode(native_decode)
        log.info("CPU decode steps: %s", "one C call for every layer" if fused else "layer by layer")
    native_prefill = _native_attention("prefill", engine_cfg.cpu_prefill_attention, config, pool)
    runner = ModelRunner(model, pool, sampler, native_decode=native_decode, native_prefill=native_prefill, lora=lora)
    limits = GrammarLimits(
        engine_cfg.grammar_compile_timeout_s, engine_cfg.grammar_cache_mb << 20, engine_cfg.grammar_compile_threads
    )
    return LLMEngine(config, scheduler, runner, Grammars(model_path, config.vocab_size, config.eos_token_ids, limits))


def _lora_manager(model, config, lora_cfg: LoRAConfig, dtype: torch.dtype, device: str) -> LoRAManager | None:
    """The adapters of ``lora_cfg``, each read and checked now: one that does not fit is a ConfigError
    (the worker exits at start-up, naming the adapter and the mismatch)."""
    if not lora_cfg.enable_lora:
        return None
    model.enable_lora()
    limits = LoRALimits(
        lora_cfg.max_loras,
        lora_cfg.max_lora_rank,
        max(lora_cfg.max_cpu_loras or lora_cfg.max_loras, lora_cfg.max_loras),
    )
    manager = LoRAManager(config, limits, dtype, device)
    for name, path in lora_cfg.modules().items():
        try:
            manager.add(name, path)
        except LoRAError as exc:
            raise ConfigError(str(exc)) from None
        log.info("LoRA adapter %s: %s", name, path)
    return manager


def _log_loaded(model, config, seconds: float) -> None:
    weights = list(model.parameters())
    num_params = sum(w.numel() for w in weights)
    size_mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    log.info(
        "loaded %s: %d layers, %s parameters, %s (%.0f MiB) in %.1f s; %s",
        config.family,
        config.num_layers,
        f"{num_params:,}",
        weights[0].dtype,
        size_mib,
        seconds,
        _memory(),
    )


def _memory() -> str:
    """This process's resident memory now and at its peak (Linux: /proc; elsewhere the peak only)."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            resident_mib = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return f"peak resident memory {peak_mib:.0f} MiB"
    return f"resident memory {resident_mib:.0f} MiB (peak {peak_mib:.0f} MiB)"


def _native_attention(kind: str, setting: str, config, pool: KVPool) -> cpu_native.NativeLibrary | None:
    """The C attention kernel for ``kind`` ("decode" or "prefill") where ``setting`` asks for it and it
    runs this model on this pool; logs the choice. Both kernels have copies for the same shapes."""
    if pool.tensor.device.type != "cpu":
        return None
    library = cpu_native.load() if setting == "c" else None
    why = None
    if library is not None and pool.layout.dtype == torch.int8:
        # The int8 pool (--kv-cache-dtype int8) has its own C kernels (decode_int8.c, kv_int8_ops.c),
        # with copies for the same shapes as the float32 ones.
        if not library.supports(config.num_heads // config.num_kv_heads, config.head_dim):
            why = f"has no copy for {config.num_heads} heads over {config.num_kv_heads} KV heads of {config.head_dim}"
    elif library is not None and not supports_native_decode(library, config.num_heads, pool):
        why = (
            f"has no copy for {config.num_heads} heads over {config.num_kv_heads} KV heads of {config.head_dim}, "
            f"{pool.layout.dtype}"
        )
    elif library is not None and _one_thread_too_few(library):
        why = f"was built without OpenMP, and torch has {torch.get_num_threads()} threads"
    if library is None or why:
        log.info("CPU %s attention: torch%s", kind, f" (the C kernel {why})" if why else "")
        return None
    log.info("CPU %s attention: the C kernel%s", kind, "" if library.threaded else ", on one thread (no OpenMP)")
    return library


def _one_thread_too_few(library: cpu_native.NativeLibrary) -> bool:
    """A build without OpenMP runs on the calling thread alone: past ``SERIAL_MAX_THREADS`` torch's
    threads do the same work faster (the C linear needs no such rule: load-time timing judges it)."""
    return not library.threaded and torch.get_num_threads() > cpu_native.SERIAL_MAX_THREADS


class LLM:
    """``LLM(path, block_size=8, ...)``: keyword overrides are fields of the config's engine section (or
    of its lora section: ``enable_lora``, ``lora_modules``, ``max_loras``, ...)."""

    def __init__(
        self,
        model: str,
        config_path: str | None = None,
        config: PdserveConfig | None = None,
        device: str | None = None,
        **engine_overrides,
    ):
        """``device``: "cpu" or "cuda"; None: CUDA when there is a GPU (build_engine)."""
        if config is None:
            sections = {k: "lora" if k in LoRAConfig.__dataclass_fields__ else "engine" for k in engine_overrides}
            config = load_config(config_path, overrides={f"{sections[k]}.{k}": v for k, v in engine_overrides.items()})
        self.model_path = model
        self.engine = build_engine(model, config.model, config.engine, device=device, lora_cfg=config.lora)
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            # a GGUF file's tokenizer is the one materialised beside its config (configs/gguf_source.py)
            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.model_path))
        return self._tokenizer

    def apply_chat_template(self, user_text: str) -> str:
        messages = [{"role": "user", "content": user_text}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(
        self, prompts: Seq[str] | Seq[list[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. Text prompts are
        tokenized with the checkpoint's tokenizer and outputs detokenized; token-id prompts are not."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        assert len(params) == len(prompts), "one SamplingParams per prompt"
        is_text = bool(prompts) and isinstance(prompts[0], str)
        token_lists = [self.tokenizer.encode(p) for p in prompts] if is_text else prompts
        ids: list[int] = []
        try:
            for tokens, p in zip(token_lists, params):
                ids.append(self.engine.add_request(list(tokens), p))
        except ValueError:
            for request_id in ids:  # a bad prompt fails the call; nothing stays queued
                self.engine.abort(request_id)
            raise
        done: dict[int, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                done[output.request_id] = output
        results = [done[i] for i in ids]
        if is_text:
            for result in results:
                for completion in result.outputs:
                    completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return results
