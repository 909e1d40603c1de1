"""The speculator of ``--speculative-config``: the n-gram proposer, or a draft model (a checkpoint of the
target's tokenizer, or the target's own first layers) with its own KV pool, block manager and runner."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from configs.schema import ConfigError, EngineConfig
from engine.kv.block_manager import BlockManager
from engine.kv.pool import KVLayout, KVPool
from engine.model.loader import load_model
from engine.sampling.sampler import Sampler
from engine.spec.config import SpeculativeConfigError, parse_speculative_config
from engine.spec.draft import DraftProposer
from engine.spec.draft_model import DraftModelError, EarlyExitDraft, check_same_vocabulary, self_draft_layers
from engine.spec.speculator import Speculator
from engine.step.runner import ModelRunner
from kernels.cpu import native as cpu_native

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SpeculatorInputs:
    engine_cfg: EngineConfig  # speculative_config, block size, prefix caching, the CPU kernel settings
    model: object  # the target CausalLM (a "self:N" draft runs its first N layers)
    config: object  # the target's HFModelConfig
    num_blocks: int  # the target pool's blocks: the draft's pool gets as many
    sampler: Sampler  # the target's: drafts are drawn with each request's filters and generator
    device: str


def build_speculator(inputs: SpeculatorInputs, native_attention: Callable) -> Speculator | None:
    """The speculator ``engine_cfg.speculative_config`` asks for (None: none); a draft model is loaded
    (or cut from the target) here, with a pool of ``num_blocks`` blocks as the target's.
    ``native_attention(kind, setting, config, pool)``: the C attention kernel for the draft's pool or None
    (engine/llm.py picks it for the target the same way). Raises ConfigError, naming the problem."""
    engine_cfg, num_blocks, sampler = inputs.engine_cfg, inputs.num_blocks, inputs.sampler
    try:
        spec = parse_speculative_config(engine_cfg.speculative_config)
    except SpeculativeConfigError as exc:
        raise ConfigError(str(exc)) from None
    if spec is None:
        return None
    log.info("speculative decoding: %s", spec)
    if spec.method == "ngram":
        return Speculator(spec)
    try:
        draft, draft_config, num_layers = _draft_model(spec.model, inputs.model, inputs.config, inputs.device)
    except DraftModelError as exc:
        raise ConfigError(str(exc)) from None
    dtype = next(inputs.model.parameters()).dtype  # the draft's K/V in the weights' dtype, whatever the target pool's
    layout = KVLayout(
        num_layers, num_blocks, engine_cfg.block_size, draft_config.num_kv_heads, draft_config.head_dim, dtype
    )
    pool = KVPool(layout, device=inputs.device)
    runner = ModelRunner(
        draft,
        pool,
        sampler,
        native_decode=native_attention("decode", engine_cfg.cpu_decode_attention, draft_config, pool),
        native_prefill=native_attention("prefill", engine_cfg.cpu_prefill_attention, draft_config, pool),
    )
    log.info("draft model %s: %d layers, KV pool of %d blocks", spec.model, num_layers, num_blocks)
    blocks = BlockManager(num_blocks, engine_cfg.block_size, enable_prefix_caching=engine_cfg.enable_prefix_caching)
    return Speculator(spec, DraftProposer(runner, blocks, sampler))


def _draft_model(path: str, target, target_config, device: str):
    """(draft, its config, its layer count) for ``"model": path``: the target's first N layers for
    "self:N", else the checkpoint at ``path``, which must share the target's vocabulary."""
    num_layers = self_draft_layers(path, target_config.num_layers)
    if num_layers is not None:
        return EarlyExitDraft(target, num_layers), target_config, num_layers
    draft, draft_config = load_model(path, dtype=next(target.parameters()).dtype, device=device)
    check_same_vocabulary(path, draft_config.vocab_size, target_config.vocab_size)
    if target.native_layer_ops:
        draft.use_native_layer_ops(cpu_native.load())
    return draft, draft_config, draft_config.num_layers
