"""The AVX2 integer dot (kernels/cpu/quant_avx2.h) gives the very sums of the VNNI one, built for each
instruction level this CPU runs (an AVX-512 machine runs the AVX2 and AVX-VNNI builds too).

How the sums are checked bit for bit: activations that are integers with a 127 in every block of 16 are
quantized by the kernel at scale 1, exactly; weight scales (and mins) that are powers of two make every
product and partial sum a float32 that rounds nothing while the sums stay under 2^24 units of the
smallest power (asserted on the data). Then every build's output equals the float64 reference bit for
bit, and so each other, and any wrong or saturated integer sum shows. The worst case for vpmaddubsw's
s16 pairs: Q8_0 bytes of 127 and -128 against activations of +-127."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from kernels.cpu import forms_cache, quant
from tests.quant_blocks import F16_FIELDS, random_rows

UNIT = 2.0**-6  # every weight scale and min: +-UNIT (Q6_K's int8 sub-scales and Q4_K's 6-bit ones multiply it)
BUILDS = {"scalar": {"scalar": True}} | {level: {"level": level} for level in quant.levels_here()}


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    library = quant.load(**BUILDS[request.param])
    assert library is not None, "no C compiler builds kernels/cpu/quant.c here"
    return library


def _exact_rows(type_name: str, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random rows whose scale and min fields are +-UNIT (positive for Q4_K's d and dmin); with their
    float64 values."""
    if type_name == "I8":  # f32 scale, then int8 values
        q = np.random.default_rng(seed).integers(-128, 128, (out_features, in_features), dtype=np.int8)
        scale = np.full((out_features, 1), UNIT, dtype=np.float32)
        rows = np.concatenate([scale.view(np.uint8), q.view(np.uint8)], axis=1)
        return torch.from_numpy(rows), q.astype(np.float64) * UNIT
    raw = random_rows(type_name, out_features, in_features, seed=seed)
    blocks = raw.reshape(out_features, -1, GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1])
    signs = np.random.default_rng(seed + 1).choice([-1.0, 1.0], blocks.shape[:2])
    for offset in F16_FIELDS[type_name]:
        value = UNIT * (1.0 if type_name == "Q4_K" else signs)
        field = np.broadcast_to(np.float16(value), blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = field.view(np.uint8).reshape(*blocks.shape[:2], 2)
    rows = blocks.reshape(out_features, -1)
    return torch.from_numpy(rows), dequantize(rows, GGMLQuantizationType[type_name]).astype(np.float64)


def _exact_x(rows: int, in_features: int, seed: int, amplitude: int) -> torch.Tensor:
    """Integers in [-amplitude, amplitude] with one +-127 per block of 16: the kernel's int8 values as they are."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-amplitude, amplitude + 1, (rows, in_features)).astype(np.float32)
    x[:, ::16] = rng.choice([-127.0, 127.0], (rows, in_features // 16))
    return torch.from_numpy(x)


# per value, in UNITs, what a kernel's partial sums add besides |w|: its offset times the largest scale
# (the integer dot runs on w / s + offset), or the largest min
_BESIDES_W = {"Q8_0": 128, "I8": 128, "Q4_0": 8, "Q4_1": 1, "Q5_0": 16, "Q5_1": 1, "Q4_K": 63, "Q6_K": 32 * 128}


def _check_exact(lib, type_name: str, w: torch.Tensor, w_ref: np.ndarray, x: torch.Tensor) -> None:
    # the premise: no partial sum of any build's order reaches 2^24 UNITs
    bound = (np.abs(x.double().numpy()) @ (np.abs(w_ref) / UNIT + _BESIDES_W[type_name]).T).max()
    assert bound < 2**24, f"test data too large for exact float32 sums: {bound}"
    expected = x.double().numpy() @ w_ref.T
    y = lib.linear(type_name, x, w, w_ref.shape[1]).double().numpy()
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "I8"))
@pytest.mark.parametrize("in_features", (96, 256))  # 96: an odd count of blocks
def test_32_value_formats_exact_at_every_row_count(lib, type_name, in_features):
    w, w_ref = _exact_rows(type_name, 13, in_features, seed=in_features)
    for rows in (*range(1, 10), 16, 33):
        _check_exact(lib, type_name, w, w_ref, _exact_x(rows, in_features, seed=rows, amplitude=20))


@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K"))
@pytest.mark.parametrize("rows", (1, 3, 8, 17, 33))  # from 8: the 16-row panels, 9 outputs a masked panel
def test_k_quants_exact(lib, type_name, rows):
    w, w_ref = _exact_rows(type_name, 9, 256, seed=rows)
    _check_exact(lib, type_name, w, w_ref, _exact_x(rows, 256, seed=rows, amplitude=3))


@pytest.mark.parametrize("type_name", ("Q8_0", "I8"))
@pytest.mark.parametrize("rows", (1, 5, 16))
def test_int8_weights_at_the_pair_sum_limits(lib, type_name, rows):
    """Weights of 127 and -128 against activations of +-127: u = w + 128 pairs reach 2 * 255 * 127 (a plain
    vpmaddubsw of u saturates there), |w| pairs 2 * 128 * 127 = 32512."""
    w, w_ref = _exact_rows(type_name, 7, 64, seed=rows)
    extremes = np.where(np.random.default_rng(rows).random(w_ref.shape) < 0.5, 127, -128)
    if type_name == "I8":
        w[:, 4:] = torch.from_numpy(extremes.astype(np.int8).view(np.uint8))
    else:
        blocks = w.view(7, 2, 34)
        blocks[:, :, 2:] = torch.from_numpy(extremes.astype(np.int8).view(np.uint8).reshape(7, 2, 32))
    w_ref = extremes * (UNIT if type_name == "I8" else _q8_scales(w))
    x = torch.from_numpy(np.random.default_rng(rows + 1).choice([-127.0, 127.0], (rows, 64)).astype(np.float32))
    _check_exact(lib, type_name, w, w_ref, x)


def _q8_scales(w: torch.Tensor) -> np.ndarray:
    """Each value's block scale of Q8_0 rows [out, 68] (two blocks)."""
    d = w.view(-1, 2, 34)[:, :, :2].contiguous().numpy().view(np.float16).astype(np.float64)  # [out, 2, 1]
    return np.repeat(d[:, :, 0], 32, axis=1)


def test_each_level_builds_its_own_path_into_its_own_file():
    """The instruction level is in the kernel cache's key (the build command), and so in the forms cache's
    (which holds the library's file name): variants never share a file."""
    libs = {name: quant.load(**kwargs) for name, kwargs in BUILDS.items()}
    paths = {forms_cache.path_for(("quantized", ()), lib.name) for lib in libs.values()}
    assert len({lib.name for lib in libs.values()}) == len(libs) == len(paths)
    assert (libs["scalar"].vnni, libs["scalar"].avx2, libs["scalar"].tiles512) == (False, False, False)
    if "x86-64-v3" in libs:
        assert (libs["x86-64-v3"].vnni, libs["x86-64-v3"].avx2, libs["x86-64-v3"].tiles512) == (False, True, False)
    if "avx-vnni" in libs:
        assert (libs["avx-vnni"].vnni, libs["avx-vnni"].avx2, libs["avx-vnni"].tiles512) == (True, False, False)


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="instruction level 'x86-64-v9' is not one of"):
        quant.load(level="x86-64-v9")
