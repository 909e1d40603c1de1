"""The 16-bit weight kernels (kernels/cpu/half.c) against a float64 matmul of the same weights and the same
activation rounding, in every build this CPU runs: vdpbf16ps (AVX512-BF16), AVX-512F, AVX2 + F16C and
plain C.

What is compared: BF16 rows multiply x split into hi = bf16(x) and lo = bf16(x - hi) (round to nearest
even, denormal halves as zero), so the reference is W @ (hi + lo) in float64; F16 rows multiply x itself.
Two checks. On integer-valued data every product and partial sum is a float32 that rounds nothing
(asserted on the data), so each build's output must equal the reference bit for bit: a wrong index,
tail mask, tile or rounding of x shows. On random data the float32 sums may round, so the difference
is held to the classical bound of any summation order of n terms, gamma_n * sum |terms| with
gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 3.1): derived from the rounding,
with n the terms of one output (2 K + 1 for BF16's two halves and the bias)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import half

BUILDS = {"scalar": {"scalar": True}} | {level: {"level": level} for level in half.levels_here()}
# in, out: a 576 model width, a row tail of every kind (not a multiple of 32, 16 or 8), a single value
SHAPES = [(576, 33), (100, 7), (7, 5), (1536, 3), (40, 1)]
U = 2.0**-24


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    library = half.load(**BUILDS[request.param])
    assert library is not None, "no C compiler builds kernels/cpu/half.c here"
    return library


def split_bf16(x: torch.Tensor, once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's bf16 halves of float32 x as float64: hi = bf16(x), lo = bf16(x - hi) (0 when ``once``)."""

    def rounded(v: torch.Tensor) -> torch.Tensor:
        r = v.to(torch.bfloat16).float()
        return torch.where(r.abs() < 2.0**-126, torch.zeros_like(r), r)  # vdpbf16ps reads denormals as 0

    hi = rounded(x)
    lo = torch.zeros_like(hi) if once else rounded(x - hi)
    return hi.double(), lo.double()


def reference(type_name, w16: torch.Tensor, x: torch.Tensor, bias, once: bool = False):
    """(float64 result, float64 sum of |terms|, terms per output) of the kernel's function."""
    w = w16.double()
    if type_name == "F16":
        parts = [x.double()]
    else:
        parts = list(split_bf16(x, once))
    y = sum(p @ w.T for p in parts)
    size = sum(p.abs() @ w.abs().T for p in parts)
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size, len(parts) * w.shape[1] + 1


def run(lib, type_name, w16: torch.Tensor, x: torch.Tensor, bias, once: bool = False) -> torch.Tensor:
    rows = w16.contiguous().view(torch.uint8)  # [out, 2 in]: the GGUF tensor's bytes
    tag = half.BF16_ONCE if once else type_name
    return lib.linear(tag, x, rows, w16.shape[1], bias)


def _dtype(type_name: str) -> torch.dtype:
    return torch.float16 if type_name == "F16" else torch.bfloat16


@pytest.mark.parametrize("type_name", ("BF16", "F16"))
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_exact_on_integer_data(lib, type_name, in_features, out_features):
    g = torch.Generator().manual_seed(in_features * 31 + out_features)
    w16 = torch.randint(-8, 9, (out_features, in_features), generator=g).to(_dtype(type_name))
    # x = an integer below 128 plus sixteenths: 11 significant bits, so BF16's hi and lo both carry some
    x = (torch.randint(-127 * 16, 127 * 16 + 1, (131, in_features), generator=g) / 16).float()
    bias = torch.randint(-64, 65, (out_features,), generator=g).float()
    hi, lo = split_bf16(x)
    if type_name == "BF16":
        assert torch.equal(hi + lo, x.double()) and (lo != 0).any(), "the data must use both halves, exactly"
    expect, size, _ = reference(type_name, w16, x, bias)
    assert size.max() < 2**24 / 16, "every partial sum must be a float32 multiple of 1/16 that rounds nothing"
    # every tail of a 4-row activation tile, and past half.c's blocks of 64 rows (131: two and a 3-row tail)
    for rows in (1, 2, 3, 4, 5, 8, 16, 19, 64, 65, 131):
        got = run(lib, type_name, w16, x[:rows], bias)
        assert torch.equal(got.double(), expect[:rows]), (lib.instructions, rows)


@pytest.mark.parametrize("type_name", ("BF16", "F16"))
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", (False, True))
def test_random_within_the_rounding_bound(lib, type_name, in_features, out_features, with_bias):
    g = torch.Generator().manual_seed(in_features + out_features)
    w16 = (torch.randn(out_features, in_features, generator=g) * 0.05).to(_dtype(type_name))
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(17, in_features, generator=g) * 3
    for rows in (1, 3, 4, 17):
        got = run(lib, type_name, w16, x[:rows], bias).double()
        expect, size, n = reference(type_name, w16, x[:rows], bias)
        bound = n * U / (1 - n * U) * size
        assert ((got - expect).abs() <= bound).all(), (lib.instructions, rows, ((got - expect).abs() / size).max())


def test_rounding_once_is_llama_cpps_function(lib):
    """HALF_BF16_ONCE (measured against the split, benchmarks/engine/half_linear.py): x rounded to bf16 once."""
    g = torch.Generator().manual_seed(5)
    w16 = (torch.randn(9, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(6, 576, generator=g)
    got = run(lib, "BF16", w16, x, None, once=True).double()
    expect, size, n = reference("BF16", w16, x, None, once=True)
    assert ((got - expect).abs() <= n * U / (1 - n * U) * size).all()
    split, _, _ = reference("BF16", w16, x, None)
    assert not torch.allclose(expect, split, rtol=0, atol=1e-6), "the two roundings must be distinguishable here"


@pytest.mark.parametrize("type_name", ("BF16", "F16"))
def test_dequantize_is_the_weights_exactly(lib, type_name):
    w16 = torch.randn(11, 100).to(_dtype(type_name))
    rows = w16.view(torch.uint8)
    assert torch.equal(lib.dequantize(type_name, rows, 100), w16.float())
    assert torch.equal(lib.dequantize(type_name, rows, 100, start=3, count=5), w16[3:8].float())


def test_each_level_builds_its_own_path():
    paths = {level: half.load(level=level).instructions for level in half.levels_here()}
    paths["scalar"] = half.load(scalar=True).instructions
    assert paths["scalar"] == "plain C"
    assert paths.get("x86-64-v3", "AVX2+F16C") == "AVX2+F16C"
    assert paths.get("x86-64-v4", "AVX-512F") == "AVX-512F"
