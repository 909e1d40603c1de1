"""The quantized linear's two forms (engine/quant/linear.py) compute one function: the ``panel`` form
rounds activations to two terms of int8 blocks exactly as the ``int`` kernel does (engine/quant/act_blocks.py), so
which form the start-up timing picks for a row count moves the output only by the order of float32
sums. Before, the panel form multiplied unrounded activations, and the same prompt on the same GGUF
answered differently in two processes whose timings picked differently."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.quant.act_blocks import as_int8_blocks, as_int8_terms
from engine.quant.linear import quantized_linear
from engine.quant.weight import QuantizedWeight
from kernels.cpu import quant
from tests.quant_blocks import random_rows


@pytest.fixture(scope="module")
def lib():
    library = quant.load()
    assert library is not None, "no C compiler builds kernels/cpu/quant.c here"
    return library


@pytest.fixture(scope="module")
def lib16():
    return quant.load(activations="int16")


def _identity_i8(width: int) -> QuantizedWeight:
    """An I8 weight that is the identity exactly: every row's scale 1.0, one int8 1 on the diagonal."""
    scale = torch.ones(width, 1).view(torch.uint8)  # [width, 4]
    q = torch.eye(width, dtype=torch.int8).view(torch.uint8)
    return QuantizedWeight("I8", torch.cat([scale, q], dim=1).contiguous(), width)


def test_rounding_is_the_int_kernels_value_for_value(lib):
    """Through an exact identity the int kernel returns its own rounded activations d * q: equal, not
    close. Many random rows (a value landing on a half, 98.5, turns up about once per million: a scale
    computed as torch's reciprocal times 127 rounded it the other way) and blocks planted on halves."""
    width = 768
    x = torch.randn(2048, width, generator=torch.Generator().manual_seed(17))
    ties = torch.tensor([127.0, 98.5, 97.5, -3.5, 2.5, -0.5, 0.5, 1.5] * 4)  # amax 127: inv 1, halves stay halves
    x[0, :32], x[1, 32:64] = ties, -ties
    x[2, 64:96] = 0  # an all-zero block
    got = lib.linear("I8", x, _identity_i8(width).rows, width)
    assert torch.equal(got, as_int8_blocks(x)) and torch.equal(got, as_int8_terms(x, 1))
    assert got[0, :8].tolist() == [127.0, 98.0, 98.0, -4.0, 2.0, -0.0, 0.0, 2.0]  # half to even


def test_two_terms_are_the_int_kernels_value_for_value(lib16):
    """With model.quant_activations int16 the kernel adds a second int8 term, what the first rounding left:
    through the identity it returns the two terms' sum, equal to act_blocks' to the bit, and within
    what the second rounding can leave."""
    width = 768
    x = torch.randn(2048, width, generator=torch.Generator().manual_seed(18))
    ties = torch.tensor([127.0, 98.5, 97.5, -3.5, 2.5, -0.5, 0.5, 1.5] * 4)
    x[0, :32], x[1, 64:96] = ties, 0
    got = lib16.linear("I8", x, _identity_i8(width).rows, width)
    assert torch.equal(got, as_int8_terms(x, 2))
    # the halves the first term rounded to even (+-0.5 left, at a scale of 0.5 / 127) come back
    assert got[0, :8].tolist() == ties[:8].tolist()
    # what is left is within half a step of the second rounding, whose block max is at most half a step of
    # the first: max|x| / 254 / 254 per block of 16, plus float32's rounding of the residual's product and
    # of the terms' sum (an ulp of x)
    blocks = x.reshape(x.shape[0], -1, 16)
    bound = blocks.abs().amax(dim=-1, keepdim=True) / 254 / 254 + blocks.abs() * 2.0**-23
    assert ((got - x).reshape(blocks.shape).abs() <= bound).all()
    # and what is left after both is within half a step of the second rounding, whose block max is at
    # most half a step of the first: max|x| / 254 / 254 per block of 16, plus float32's rounding of the
    # residual's product and of the terms' sum (an ulp of x)
    blocks = x.reshape(x.shape[0], -1, 16)
    bound = blocks.abs().amax(dim=-1, keepdim=True) / 254 / 254 + blocks.abs() * 2.0**-23
    assert ((got - x).reshape(blocks.shape).abs() <= bound).all()


@pytest.mark.parametrize("activations", quant.ACTIVATIONS)
@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"))
@pytest.mark.parametrize("rows", (1, 7, 37, 130))
def test_int_and_panel_forms_agree_to_float32_sums(activations, type_name, rows):
    lib = quant.load(activations=activations)
    out_features, in_features = 301, 768
    raw = random_rows(type_name, out_features, in_features, seed=rows)
    weight = QuantizedWeight(type_name, torch.from_numpy(raw), in_features)
    w_ref = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)  # [out, in]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(1))
    expected = as_int8_terms(x, lib.act_terms).double().numpy() @ w_ref.T + bias.double().numpy()
    # float32 sums of in_features products: test_quant_kernels.py's bound for the int kernel
    tolerance = 2e-5 * np.abs(expected).max() * np.sqrt(in_features / 256)
    for form in ("int", "panel"):
        got = quantized_linear(x, weight, lib, form, bias).double().numpy()
        np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0, err_msg=form)
