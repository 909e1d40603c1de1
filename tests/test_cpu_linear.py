"""The CPU matmul forms of engine/cpu_linear.py against F.linear, on the shapes and strides the engine
gives them (the MLP's down_proj reads a strided half of gate_up)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import FEW_ROWS, Linear, linear_transposed


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [3, FEW_ROWS, FEW_ROWS + 1])
def test_linear_module_matches_nn_linear_with_bias(threads, rows):
    gen = torch.Generator().manual_seed(rows)
    reference = torch.nn.Linear(32, 20, bias=True)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(20, 32, generator=gen))
        reference.bias.copy_(torch.randn(20, generator=gen))
    layer = Linear(32, 20, bias=True)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(rows, 32, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
