"""The quantized CPU kernels (kernels/cpu/quant.c) against llama.cpp's own Python decoding of the same bytes
(``gguf.quants.dequantize``) and a float64 matmul, on irregular shapes, in each build (the machine's best,
plain C, AVX2 without VNNI and 256-bit AVX-VNNI where the CPU runs them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.quant.int8 import dequantize_int8, quantize_int8
from kernels.cpu import quant
from tests.quant_blocks import activation_bound, random_rows

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
# rows, in (a multiple of the K-quants' 256), out
SHAPES = [(1, 256, 17), (3, 512, 33), (17, 1024, 7), (64, 4096, 5), (1, 4096, 129)]


def _int8_blocks(x: np.ndarray) -> np.ndarray:
    """float32 x with each block of 16 rounded to int8 at scale max|x| / 127 (halves to even), as d * q."""
    blocks = x.reshape(x.shape[0], -1, 16).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    scale = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * scale).astype(np.float32).reshape(x.shape)


def _x_as_kernel_quantizes(x: np.ndarray, terms: int) -> np.ndarray:
    """x as the kernel multiplies it: rounded to int8 blocks, and with two terms plus what that left
    rounded the same way."""
    first = _int8_blocks(x.astype(np.float32))
    if terms == 1:
        return first.astype(np.float64)
    second = _int8_blocks((x.astype(np.float32) - first).astype(np.float32))
    return first.astype(np.float64) + second.astype(np.float64)


# the machine's best build, plain C, and the AVX2 path (kernels/cpu/quant_avx2.h) and 256-bit VNNI one where
# the CPU runs them: random activations, so each build's activation scales (one per 16) are checked
BUILDS = {"best": {}, "scalar": {"scalar": True}} | {
    name: {"level": level}
    for name, level in (("avx2", "x86-64-v3"), ("avx-vnni", "avx-vnni"))
    if level in quant.levels_here()
}


@pytest.fixture(params=[(build, activations) for build in BUILDS for activations in quant.ACTIVATIONS])
def lib(request):
    """Each build, with activations in one int8 term and in two (model.quant_activations int8, int16)."""
    build, activations = request.param
    library = quant.load(**BUILDS[build], activations=activations)
    assert library is not None, "no C compiler builds kernels/cpu/quant.c here"
    return library


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_linear_matches_gguf_dequantize(lib, type_name, rows, in_features, out_features):
    w = random_rows(type_name, out_features, in_features, seed=rows + out_features)
    w_ref = dequantize(w, GGMLQuantizationType[type_name]).astype(np.float64)  # [out, in]
    _check_linear(lib, type_name, torch.from_numpy(w), w_ref, rows, seed=out_features)


# 32-value formats at odd sub-block counts (the 512-bit tiles' masked last half), odd output counts (a
# tile's repeated last weight row) and every activation-row tail of a tile, 1..70 rows
ODD_SHAPES = [(96, 3), (608, 31), (32, 4), (160, 9)]  # in, out


@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "I8"))
@pytest.mark.parametrize("in_features,out_features", ODD_SHAPES)
def test_linear_at_odd_block_counts_and_every_row_count(lib, type_name, in_features, out_features):
    if type_name == "I8":
        weight = quantize_int8(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)))
        w, w_ref = weight.rows, dequantize_int8(weight).double().numpy()
    else:
        raw = random_rows(type_name, out_features, in_features, seed=in_features)
        w, w_ref = torch.from_numpy(raw), dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    for rows in (*range(1, 10), 16, 33, 70):
        _check_linear(lib, type_name, w, w_ref, rows, seed=rows)


@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K"))
@pytest.mark.parametrize("rows", [2, 5, 8, 13, 70])  # from 8 rows the 16-row panels (quant_panel16.c)
def test_k_quants_at_row_tails(lib, type_name, rows):
    raw = random_rows(type_name, 11, 768, seed=rows)
    w_ref = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    _check_linear(lib, type_name, torch.from_numpy(raw), w_ref, rows, seed=rows)


def _check_linear(lib, type_name: str, w: torch.Tensor, w_ref: np.ndarray, rows: int, seed: int) -> None:
    """The kernel's ``x @ W^T + bias`` against float64 references on W's dequantized values ``w_ref``."""
    out_features, in_features = w_ref.shape
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(seed + 1))
    y = lib.linear(type_name, x, w, in_features, bias).double().numpy()
    # the kernel's own arithmetic: exact up to float32 sums
    expected = _x_as_kernel_quantizes(x.numpy(), lib.act_terms) @ w_ref.T + bias.double().numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y, expected, atol=2e-5 * scale * np.sqrt(in_features / 256), rtol=0)
    # and against unquantized activations: within what rounding them to int8 blocks can move each output
    # (tests/quant_blocks.py), plus the float32 sums' slack above
    exact = x.double().numpy() @ w_ref.T + bias.double().numpy()
    slack = 2e-5 * scale * np.sqrt(in_features / 256)
    assert (np.abs(y - exact) <= activation_bound(x.double().numpy(), w_ref, lib.act_terms) + slack).all()


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_exactly(lib, type_name):
    w = random_rows(type_name, 19, 512, seed=3)
    panel = lib.dequantize(type_name, torch.from_numpy(w), 512, start=5, count=11).numpy()
    np.testing.assert_array_equal(panel, dequantize(w, GGMLQuantizationType[type_name])[5:16])


def test_zero_activations_give_bias(lib):
    w = random_rows("Q4_K", 9, 256)
    bias = torch.arange(9, dtype=torch.float32)
    y = lib.linear("Q4_K", torch.zeros(2, 256), torch.from_numpy(w), 256, bias)
    torch.testing.assert_close(y, bias.expand(2, 9), rtol=0, atol=0)


def test_every_float16_scale_decodes_exactly(lib):
    """quant_formats.h's f16(): all 65,536 bit patterns as Q8_0 block scales times q = 1, against numpy's
    float16 (subnormals, infinities and NaNs included)."""
    patterns = np.arange(2**16, dtype=np.uint16)  # one block each: 2,048 rows of 32 blocks
    blocks = np.zeros((2**16, 34), dtype=np.uint8)
    blocks[:, :2] = patterns.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = 1
    rows = torch.from_numpy(blocks.reshape(2048, 32 * 34))
    got = lib.dequantize("Q8_0", rows, 32 * 32).numpy()[:, ::32].reshape(-1)
    np.testing.assert_array_equal(got, patterns.view(np.float16).astype(np.float32))
