"""The fused decode step (kernels/cpu/decode_step.c) over quantized projections (engine/quant/): a decode
step of a GGUF-format model as one C call gives the same bits as its layers called one by one with the
same kernels (kernels/cpu/quant.c), in every format, and on a model mixing quantized and float
projections; a projection whose timed form at that row count is not the integer kernel keeps the
layer path. (Greedy decoding against the dequantized model: tests/test_quant_engine.py, whose engine
takes this step.)"""

from __future__ import annotations

import pytest

from engine.llm import FUSED_DECODE_ROWS
from engine.model.loader import load_model
from engine.quant.apply import (
    PROJECTIONS,
    linear_for,
    quantize_projections,
    quantized_modules,
    set_projection,
    use_quant_activations,
)
from engine.quant.linear import QuantLinear
from tests.test_cpu_linear import use_forms_everywhere
from tests.test_fused_decode_step import RecordingHarness
from tests.test_model_parity import _prompt
from tests.test_quant_engine import _engine, _Lookup, _model_dir, _records

FORMATS = [
    *[(t, "tiny") for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "I8")],
    ("Q4_K", "k256"),
    ("Q6_K", "k256"),
]


def _quantized_model(type_name: str, size: str, library):
    model, config = load_model(_model_dir("llama", size))
    quantize_projections(model, _Lookup(model, _records("llama", size, type_name)))
    model.use_native_layer_ops(library)
    return model, config


def _decode_ten_steps(model, config, library) -> RecordingHarness:
    """Three prompts prefilled, then ten decode steps of all three; every step checked fused == layered."""
    harness = RecordingHarness(model, config, block_size=4, native_decode=library)
    prompts = [_prompt(config, n, seed=60 + n) for n in (21, 9, 30)]
    continuations = [_prompt(config, 10, seed=70 + i) for i in range(3)]
    harness.step([(rid, prompts[rid]) for rid in range(3)])
    for step in range(10):
        harness.step([(rid, [continuations[rid][step]]) for rid in range(3)])
    return harness


@pytest.mark.parametrize("type_name,size", FORMATS)
def test_fused_quantized_steps_equal_the_layer_path_bit_for_bit(type_name, size, library):
    model, config = _quantized_model(type_name, size, library)
    assert model.use_fused_decode(library)
    assert model.fused_decode.shape.quant_linear is not None
    harness = _decode_ten_steps(model, config, library)
    assert harness.fused_steps == 10  # the prefill step ran layer by layer, every decode step fused


@pytest.mark.parametrize("type_name,size", [("Q8_0", "tiny"), ("Q4_K", "k256")])
def test_fused_steps_round_activations_as_the_layers_do_with_two_terms(type_name, size, library):
    """model.quant_activations int16: the fused step's projections carry the two-term tag (the layer path's
    QuantLinear calls do), so both still give the same bits."""
    model, config = _quantized_model(type_name, size, library)
    assert use_quant_activations(model, "int16") == len(quantized_modules(model))
    assert {m.lib.act_terms for m in quantized_modules(model)} == {2}
    assert model.use_fused_decode(library)
    harness = _decode_ten_steps(model, config, library)
    assert harness.fused_steps == 10


def test_a_model_mixing_quantized_and_float_projections(library):
    """As a Q4_K_M file's layers may be: the MLP quantized, attention float on the C linear."""
    model, config = load_model(_model_dir("llama", "tiny"))
    use_forms_everywhere(model, "c")
    records = _records("llama", "tiny", "Q8_0")
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS[2:]:  # mlp.gate_up_proj, mlp.down_proj
            set_projection(layer, path, linear_for(records[(i, path)], None))
    model.use_native_layer_ops(library)
    assert model.use_fused_decode(library)
    kinds = {type(m).__name__ for layer in model.layers for m in map(layer.get_submodule, PROJECTIONS)}
    assert kinds == {"Linear", "QuantLinear"}
    assert _decode_ten_steps(model, config, library).fused_steps == 10


def test_a_projection_on_the_panel_form_keeps_the_layer_path(library):
    model, config = _quantized_model("Q4_1", "tiny", library)
    assert model.use_fused_decode(library)
    down = model.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear)
    down.use_forms(("int", "panel", *down.per_bucket[2:]))  # ROW_BUCKETS (1, 4, ...): 2..4 rows on the panel
    harness = _decode_ten_steps(model, config, library)  # three rows a step
    assert harness.fused_steps == 0


def test_the_engine_runs_quantized_decode_steps_as_one_call_on_the_int_kernel(monkeypatch):
    llm = _engine(monkeypatch, _model_dir("llama", "tiny"), _records("llama", "tiny", "Q4_1"), quantized=True)
    model = llm.engine.runner.model
    assert model.fused_decode is not None and model.fused_decode.quant is not None
    for m in quantized_modules(model):  # whatever the timing picked at decode rows
        assert {m.form_for(rows) for rows in range(1, FUSED_DECODE_ROWS + 1)} == {"int"}
