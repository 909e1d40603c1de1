"""A quantized decode step of a few rows in one OpenMP parallel region per layer (kernels/cpu/decode_step_team.c):
which steps take it, and that they give the layer path's bits -- logits and every stored K/V byte -- at one
row, at TEAM_ROWS, over a float32 and an int8 pool, and on more threads than the cores; steps past
TEAM_ROWS rows, with a float projection, or without the team kernel keep decode_step.c's calls.
(The same check at three rows in every format: tests/test_fused_decode_quant.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.quant.apply import PROJECTIONS, linear_for, set_projection
from tests.test_cpu_linear import use_forms_everywhere
from tests.test_fused_decode_quant import _quantized_model
from tests.test_fused_decode_step import RecordingHarness
from tests.test_model_parity import _prompt
from tests.test_quant_engine import _model_dir, _records

TEAM_ROWS = 4  # kernels/cpu/decode_step.h


def _decode(model, config, library, rows: int, kv_dtype=torch.float32, steps: int = 6) -> RecordingHarness:
    """``rows`` prompts prefilled, then ``steps`` decode steps of all of them, each checked fused == layered."""
    harness = RecordingHarness(model, config, block_size=4, native_decode=library, kv_dtype=kv_dtype)
    prompts = [_prompt(config, 7 + 5 * i, seed=80 + i) for i in range(rows)]
    continuations = [_prompt(config, steps, seed=90 + i) for i in range(rows)]
    harness.step(list(enumerate(prompts)))
    for step in range(steps):
        harness.step([(rid, [continuations[rid][step]]) for rid in range(rows)])
    return harness


def _takes(model, library, rows: int) -> bool:
    fused = model.fused_decode
    return library.team_takes(fused.layers, fused.shape, rows)


@pytest.mark.parametrize("type_name,size", [("Q8_0", "tiny"), ("Q4_K", "k256")])
@pytest.mark.parametrize("rows", [1, TEAM_ROWS])
def test_team_steps_equal_the_layer_path_bit_for_bit(type_name, size, rows, library):
    model, config = _quantized_model(type_name, size, library)
    assert model.use_fused_decode(library)
    assert _takes(model, library, rows)
    assert _decode(model, config, library, rows).fused_steps == 6


def test_team_steps_over_an_int8_pool(library):
    model, config = _quantized_model("Q8_0", "tiny", library)
    assert model.use_fused_decode(library) and _takes(model, library, 2)
    assert _decode(model, config, library, 2, kv_dtype=torch.int8).fused_steps == 6


def test_team_steps_on_more_threads_than_cores(library):
    model, config = _quantized_model("Q4_1", "tiny", library)
    assert model.use_fused_decode(library)
    threads = torch.get_num_threads()
    torch.set_num_threads(5)  # each thread's own rows and scratch: five of them
    try:
        assert _decode(model, config, library, 3).fused_steps == 6
    finally:
        torch.set_num_threads(threads)


def test_steps_past_team_rows_keep_a_region_per_kernel(library):
    model, config = _quantized_model("Q8_0", "tiny", library)
    assert model.use_fused_decode(library)
    assert not _takes(model, library, TEAM_ROWS + 1)
    assert _decode(model, config, library, TEAM_ROWS + 2).fused_steps == 6


def test_without_the_team_kernel_or_with_a_float_projection_no_team(library):
    model, config = _quantized_model("Q8_0", "tiny", library)
    assert model.use_fused_decode(library)
    model.fused_decode.shape.quant_team = None  # a caller that did not hand it over
    assert not _takes(model, library, 1)
    assert _decode(model, config, library, 1).fused_steps == 6

    model, config = load_model(_model_dir("llama", "tiny"))
    use_forms_everywhere(model, "c")
    records = _records("llama", "tiny", "Q8_0")
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS[2:]:  # the MLP quantized, attention float (a Q4_K_M file's layers may be)
            set_projection(layer, path, linear_for(records[(i, path)], None))
    model.use_native_layer_ops(library)
    assert model.use_fused_decode(library) and model.fused_decode.shape.quant_team is not None
    assert not _takes(model, library, 1)
