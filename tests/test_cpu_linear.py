"""The CPU matmul forms of engine/cpu_linear.py against F.linear, on the shapes and strides the engine
gives them (the MLP's down_proj reads a strided half of gate_up), and how a row count picks its form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import LM_HEAD_SLICE_ROWS, PLAIN, ROW_BUCKETS, Linear, MatmulForms, linear_transposed
from engine.loader import load_model
from tests.model_factory import tiny_model_dir


@pytest.mark.parametrize("rows", [1, 5, 64, 200])
@pytest.mark.parametrize("slice_rows", [None, 7, 1024])
def test_linear_transposed_equals_f_linear(rows, slice_rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 48, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    out = linear_transposed(x, weight, slice_rows)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_transposed_reads_a_strided_input():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 40, generator=gen)
    gate = gate_up[:, :40]  # row stride 80, as F.silu(gate, inplace=True) leaves it for down_proj
    weight = torch.randn(24, 40, generator=gen)
    torch.testing.assert_close(linear_transposed(gate, weight), F.linear(gate.contiguous(), weight),
                               rtol=1e-5, atol=1e-5)


ALL_TRANSPOSED = MatmulForms((True,) * len(ROW_BUCKETS))


def test_a_row_count_takes_the_form_of_the_first_bucket_that_holds_it():
    only_16 = MatmulForms(tuple(rows == 16 for rows in ROW_BUCKETS))
    assert [r for r in range(1, 200) if only_16.use_transposed(r)] == list(range(9, 17))
    assert not any(PLAIN.use_transposed(r) for r in range(1, 200))
    assert not ALL_TRANSPOSED.use_transposed(ROW_BUCKETS[-1] + 1)  # past the last bucket: always plain
    with pytest.raises(AssertionError):
        MatmulForms((True,))  # one flag per bucket or none


@pytest.mark.parametrize("forms", [PLAIN, ALL_TRANSPOSED], ids=["plain", "transposed"])
@pytest.mark.parametrize("rows", [3, ROW_BUCKETS[-1], ROW_BUCKETS[-1] + 1])
def test_linear_module_matches_nn_linear_with_bias(forms, rows):
    gen = torch.Generator().manual_seed(rows)
    reference = torch.nn.Linear(32, 20, bias=True)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(20, 32, generator=gen))
        reference.bias.copy_(torch.randn(20, generator=gen))
    layer = Linear(32, 20, bias=True)
    layer.load_state_dict(reference.state_dict())
    layer.forms = forms
    x = torch.randn(rows, 32, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)


def test_timed_forms_cover_every_projection_shape_once_and_the_lm_head():
    model, _ = load_model(tiny_model_dir("qwen2"))  # qwen2: a bias on qkv_proj
    chosen = model.choose_cpu_matmul_forms()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = {"x".join(map(str, m.weight.shape)) for m in linears}
    assert set(chosen) == shapes | {"lm_head"}
    for m in linears:  # one timing per shape, shared by every layer
        assert m.forms is chosen["x".join(map(str, m.weight.shape))]
        assert len(m.forms.transposed) == len(ROW_BUCKETS) and m.forms.slice_rows is None
    assert model.lm_head_forms is chosen["lm_head"] and model.lm_head_forms.slice_rows == LM_HEAD_SLICE_ROWS


def test_model_logits_are_the_same_in_either_form():
    # Whatever the timing picks, the model computes the same logits (the parity tests check PLAIN
    # against transformers).
    model, config = load_model(tiny_model_dir("qwen2"))
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain_logits = model.compute_logits(hidden)
        plain_mlp = model.layers[0].mlp(hidden)
        for m in model.modules():
            if isinstance(m, Linear):
                m.forms = ALL_TRANSPOSED
        model.lm_head_forms = MatmulForms((True,) * len(ROW_BUCKETS), LM_HEAD_SLICE_ROWS)
        torch.testing.assert_close(model.compute_logits(hidden), plain_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.layers[0].mlp(hidden), plain_mlp, rtol=1e-5, atol=1e-5)
