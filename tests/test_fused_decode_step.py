"""The fused decode step (engine/model/decode_step.py, kernels/cpu/decode_step.c): a decode step's layers as one
C call give the same bits as the layers called one by one, and transformers' logits; steps it cannot
run (prefill rows, LoRA, per-head q/k norms, other forms at that row count) keep the layer path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from configs.schema import EngineConfig, ModelConfig
from engine.llm import FUSED_DECODE_ROWS, build_engine
from engine.lora.manager import LoRAStep
from engine.model.loader import load_model
from tests.model_factory import tiny_model_dir
from tests.test_cpu_linear import use_forms_everywhere
from tests.test_model_parity import ATOL, PagedHarness, _prompt, _reference_logits


def _c_model(family: str, library):
    model, config = load_model(tiny_model_dir(family))
    use_forms_everywhere(model, "c")
    model.use_native_layer_ops(library)
    return model, config


class RecordingHarness(PagedHarness):
    """Runs every step twice on copies of the pool, fused and layer by layer, and keeps both outputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_steps = 0

    @torch.no_grad()
    def step(self, chunks):
        fused = self.model.fused_decode
        pool_before = self.pool.tensor.clone()
        self.model.fused_decode = None
        layered = super().step(chunks)
        pool_layered = self.pool.tensor.clone()
        self.pool.tensor.copy_(pool_before)
        for rid, tokens in chunks:  # replay the same step
            self.num_computed[rid] -= len(tokens)
        self.model.fused_decode = fused
        taken = []
        original_run = fused.run
        fused.run = lambda *a: taken.append(True) or original_run(*a)
        try:
            out = super().step(chunks)
        finally:
            fused.run = original_run
        self.fused_steps += bool(taken)
        for a, b in zip(out, layered):
            assert torch.equal(a, b), "the fused step's logits differ from the layer path's"
        assert torch.equal(self.pool.tensor, pool_layered), "the fused step stored other K/V"
        return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])  # qwen2: qkv bias
def test_fused_decode_steps_equal_the_layer_path_bit_for_bit_and_transformers(family, library):
    model, config = _c_model(family, library)
    assert model.use_fused_decode(library)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(family), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = [_prompt(config, 21, seed=40), _prompt(config, 9, seed=41), _prompt(config, 30, seed=42)]
    continuations = [_prompt(config, 10, seed=43 + i) for i in range(3)]
    harness = RecordingHarness(model, config, block_size=4, native_decode=library)
    prefill = harness.step([(rid, prompts[rid]) for rid in range(3)])
    assert harness.fused_steps == 0  # prefill rows: the layer path
    decoded = [[out[-1]] for out in prefill]
    for step in range(10):
        for rid, out in enumerate(harness.step([(rid, [continuations[rid][step]]) for rid in range(3)])):
            decoded[rid].append(out[0])
    assert harness.fused_steps == 10
    for rid in range(3):
        expected = _reference_logits(reference, prompts[rid] + continuations[rid])[len(prompts[rid]) - 1 :]
        torch.testing.assert_close(torch.stack(decoded[rid]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_decode_steps_over_an_int8_pool_equal_the_layer_path_bit_for_bit(family, library):
    # --kv-cache-dtype int8: the fused step stores and attends int8 rows with the int8 layer path's own
    # kernels (kv_int8_ops.c, decode_int8.c), so the logits and every stored byte (values and scales) match
    model, config = _c_model(family, library)
    assert model.use_fused_decode(library)
    prompts = [_prompt(config, 21, seed=50), _prompt(config, 40, seed=51)]
    continuations = [_prompt(config, 8, seed=52 + i) for i in range(2)]
    harness = RecordingHarness(model, config, block_size=16, native_decode=library, kv_dtype=torch.int8)
    harness.step([(rid, prompts[rid]) for rid in range(2)])
    for step in range(8):
        harness.step([(rid, [continuations[rid][step]]) for rid in range(2)])
    assert harness.fused_steps == 8


def test_steps_it_cannot_run_keep_the_layer_path(library):
    model, config = _c_model("llama", library)
    assert model.use_fused_decode(library)
    fused = model.fused_decode
    harness = PagedHarness(model, config, block_size=4, native_decode=library)
    prompt = _prompt(config, 12, seed=50)
    harness.step([(0, prompt), (1, prompt[:5])])
    # A mixed step: one decode row and one prefill chunk.
    mixed = _meta_of(harness, [(0, [7]), (2, prompt)])
    assert not fused.takes(13, mixed, None)
    decode = _meta_of(harness, [(0, [7]), (1, [8])])
    assert fused.takes(2, decode, None)
    assert fused.takes(2, decode, LoRAStep())  # no adapter in the step
    assert not fused.takes(2, decode, LoRAStep(groups=[(None, object())]))  # an adapter: LoRA deltas per layer
    harness.native_decode = None  # decode attention on the torch path
    assert not fused.takes(2, _meta_of(harness, [(0, [7]), (1, [8])]), None)


def _meta_of(harness: PagedHarness, chunks):
    """The metadata the harness would build for ``chunks`` (it runs the step, and records what the
    model saw)."""
    seen = []
    forward = harness.model.forward
    harness.model.forward = lambda ids, pos, pool, meta, lora=None: seen.append(meta) or forward(ids, pos, pool, meta)
    try:
        harness.step(chunks)
    finally:
        del harness.model.forward
    return seen[0]


def test_models_it_cannot_run_are_refused(library):
    qk_norm, _ = _c_model("qwen3", library)  # per-head q/k norms and their RoPE stay in torch
    assert not qk_norm.use_fused_decode(library) and qk_norm.fused_decode is None
    plain, _ = load_model(tiny_model_dir("llama"))
    plain.use_native_layer_ops(library)  # no C copies of the projections
    assert not plain.use_fused_decode(library)


@pytest.mark.parametrize("layer_ops,expected", [("c", True), ("torch", False)])
def test_the_engine_uses_it_with_the_c_kernels_and_the_c_linear_at_decode_rows(library, layer_ops, expected):
    path = tiny_model_dir("llama")
    engine = build_engine(
        path,
        ModelConfig(path=path, dtype="float32"),
        EngineConfig(kv_cache_memory_mb=4, cpu_layer_ops=layer_ops),
        device="cpu",
    )
    model = engine.runner.model
    assert (model.fused_decode is not None) is expected
    forms = model.layers[0].self_attn.qkv_proj.forms
    if expected:  # every decode row count on the C linear, whatever the timing picked
        assert {forms.form_for(rows) for rows in range(1, FUSED_DECODE_ROWS + 1)} == {"c"}
