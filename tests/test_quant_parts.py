"""A fused projection whose parts are in different formats (engine/quant/parts.py), as a Q4_K_M file's
q/k in Q5_0 beside v in Q8_0: each format run on its own kernel, writing its columns of one output.

Checked against the float64 product of the activations as the kernel rounds them with the parts'
weights as ``gguf.quants.dequantize`` decodes them, in both forms (int, panel) and at row counts that
take each kernel path; the kernel's column writes leave the rest of a wider output alone; and the fused
decode step (kernels/cpu/decode_step.c, decode_step_team.c) over such projections gives the layer path's
bits, as every other projection kind does (tests/test_fused_decode_quant.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.model.loader import load_model
from engine.quant.apply import PROJECTIONS, quantize_projections, set_projection
from engine.quant.parts import QuantParts, format_runs
from engine.quant.weight import QuantizedWeight
from kernels.cpu import quant
from tests.quant_blocks import random_rows
from tests.test_fused_decode_team import TEAM_ROWS, _decode, _takes
from tests.test_quant_engine import _Lookup, _model_dir, _records
from tests.test_quant_kernels import _x_as_kernel_quantizes

IN = 96  # three blocks: an odd count, the 512-bit tiles' masked last half


def _part(type_name: str, out_features: int, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    raw = random_rows(type_name, out_features, IN, seed=seed)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    return QuantizedWeight(type_name, torch.from_numpy(raw), IN), ref


@pytest.fixture(scope="module")
def lib():
    library = quant.load()
    assert library is not None, "no C compiler builds kernels/cpu/quant.c here"
    return library


def test_runs_join_neighbours_of_one_format():
    parts = [_part(t, 8, seed)[0] for seed, t in enumerate(("Q5_0", "Q5_0", "Q8_0"))]
    runs = format_runs(parts)
    assert [(r.type_name, r.out_features) for r in runs] == [("Q5_0", 16), ("Q8_0", 8)]
    assert torch.equal(runs[0].rows, torch.cat([parts[0].rows, parts[1].rows]))
    with pytest.raises(ValueError, match="a split projection takes 2..2 runs of one width; got Q5_0"):
        QuantParts(format_runs([parts[0], parts[2], parts[1]]), None, quant.load())


@pytest.mark.parametrize("form", ("int", "panel"))
@pytest.mark.parametrize("rows", (1, 3, 8, 17))
def test_split_projection_is_the_product_of_its_parts(lib, form, rows):
    (q, q_ref), (v, v_ref) = _part("Q5_0", 40, seed=1), _part("Q8_0", 13, seed=2)
    bias = torch.randn(53, generator=torch.Generator().manual_seed(3))
    module = QuantParts([q, v], bias, lib)
    for run in module.runs:
        run.use_forms((form,) * len(run.per_bucket))
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    y = module(x).double().numpy()
    expected = (
        _x_as_kernel_quantizes(x.numpy(), lib.act_terms) @ np.concatenate([q_ref, v_ref]).T + bias.double().numpy()
    )
    np.testing.assert_allclose(y, expected, atol=2e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize("rows", (1, 5, 16))
def test_a_kernel_writes_only_its_columns(lib, rows):
    w, w_ref = _part("Q5_1", 21, seed=rows)
    out = torch.full((rows, 40), float("nan"))
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    lib.linear("Q5_1", x, w.rows, IN, out=out[:, 7:28])
    assert out[:, :7].isnan().all() and out[:, 28:].isnan().all()
    torch.testing.assert_close(out[:, 7:28], lib.linear("Q5_1", x, w.rows, IN), rtol=0, atol=0)
    expected = _x_as_kernel_quantizes(x.numpy(), lib.act_terms) @ w_ref.T
    np.testing.assert_allclose(out[:, 7:28].double().numpy(), expected, atol=2e-5 * np.abs(expected).max(), rtol=0)


def _split_model(native):
    """The tiny llama with every projection quantized, q/k in Q5_0 and v in Q8_0 (a Q4_K_M layer's mix)."""
    model, config = load_model(_model_dir("llama", "tiny"))
    q5, q8 = _records("llama", "tiny", "Q5_0"), _records("llama", "tiny", "Q8_0")
    quantize_projections(model, _Lookup(model, q5))
    kv = config.num_kv_heads * config.head_dim  # v's rows: the last kv of qkv's
    for i, layer in enumerate(model.layers):
        qkv, v = q5[(i, "self_attn.qkv_proj")], q8[(i, "self_attn.qkv_proj")]
        q_k = QuantizedWeight("Q5_0", qkv.rows[:-kv].contiguous(), qkv.in_features)
        v = QuantizedWeight("Q8_0", v.rows[-kv:].contiguous(), v.in_features)
        set_projection(layer, "self_attn.qkv_proj", QuantParts([q_k, v], None, quant.load()))
    model.use_native_layer_ops(native)
    return model, config


@pytest.mark.parametrize("rows", (1, TEAM_ROWS, TEAM_ROWS + 1))
def test_fused_decode_steps_over_split_projections_equal_the_layer_path(library, rows):
    model, config = _split_model(library)
    kinds = {type(m).__name__ for layer in model.layers for m in map(layer.get_submodule, PROJECTIONS)}
    assert kinds == {"QuantParts", "QuantLinear"}
    assert model.use_fused_decode(library)
    assert model.fused_decode.layers[0].qkv.split == model.layers[0].self_attn.qkv_proj.runs[0].out_features
    # up to TEAM_ROWS rows in one region a layer (decode_step_team.c), past them decode_step.c's calls
    assert _takes(model, library, rows) == (rows <= TEAM_ROWS)
    assert _decode(model, config, library, rows).fused_steps == 6
