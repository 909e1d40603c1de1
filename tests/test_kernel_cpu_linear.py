"""The C linear (kernels/cpu/linear.c) against a float64 product, in every build the decode-attention
tests build (each vector width, and without OpenMP), at row counts that cross its 6-, 4-, 2- and 1-row
tiles; its packed copy holding exactly the weight's values; the same bits on one thread and two and
for a row whatever the batch around it; the shapes it takes; and the engine's switch for it."""

from __future__ import annotations

import pytest
import torch

from configs.schema import EngineConfig, ModelConfig
from engine.llm import build_engine
from engine.model.cpu_linear import Linear
from kernels.cpu import native as cpu_native
from tests.model_factory import tiny_model_dir

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 30]


def case(rows: int, in_features: int, out_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen)
    return x, weight, bias


@pytest.mark.parametrize("shape", [(16, 64), (48, 192), (512, 128)], ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_c_linear_matches_float64(any_build, shape, with_bias):
    for rows in ROWS:
        x, weight, bias = case(rows, *shape, seed=rows)
        bias = bias if with_bias else None
        expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        out = any_build.linear(x, any_build.pack_linear(weight), bias)
        assert out.shape == (rows, shape[1]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"{rows} rows")


def test_c_linear_reads_a_strided_input(library):
    x, weight, _ = case(6, 64, 64, seed=1)
    wide = torch.randn(6, 128)
    wide[:, :64] = x
    strided = wide[:, :64]  # row stride 128: the MLP's down_proj input
    torch.testing.assert_close(library.linear(strided, library.pack_linear(weight)), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_the_packed_copy_is_the_weight_reordered(any_build):
    _, weight, _ = case(1, 48, 192, seed=2)
    packed = any_build.pack_linear(weight)
    block = any_build.linear_block
    assert packed.shape == (192 // block, 48, block) and 64 % block == 0
    # packed[n // NR][k][n % NR] == weight[n][k], every value exactly
    assert torch.equal(packed.permute(0, 2, 1).reshape(192, 48), weight)


def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(any_build):
    """Each output is one sum in k order in every tile (6, 4, 2 or 1 rows): a request's logits do not
    depend on the batch it is decoded in."""
    x, weight, _ = case(13, 96, 128, seed=3)
    packed = any_build.pack_linear(weight)
    whole = any_build.linear(x, packed)
    for rows in (1, 2, 3, 5, 6, 7):
        assert torch.equal(any_build.linear(x[:rows], packed), whole[:rows]), rows
    assert torch.equal(any_build.linear(x[12:], packed), whole[12:])


def test_c_linear_gives_the_same_bits_on_one_thread_and_two(any_build):
    x, weight, bias = case(13, 512, 1024, seed=5)
    weight = any_build.pack_linear(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = any_build.linear(x, weight, bias)
        torch.set_num_threads(2)
        two = any_build.linear(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # every output is one thread's sum, in one order


def test_shapes_the_c_linear_takes(library):
    # Any number of inputs, outputs a multiple of 64 (each build's block of outputs divides it).
    assert [n for n in (0, 32, 64, 100, 128, 192, 32000) if library.supports_linear(64, n)] == [64, 128, 192, 32000]
    assert [k for k in (0, 1, 16, 18, 64, 896, 1001) if library.supports_linear(k, 64)] == [1, 16, 18, 64, 896, 1001]


def test_the_engine_times_the_c_linear_unless_told_torch():
    library = cpu_native.load()  # the engine's (other tests rebuild the loader's cache: not the fixture)
    path = str(tiny_model_dir("llama"))
    model = ModelConfig(path=path, dtype="float32")
    for setting in ("c", "torch"):
        engine = build_engine(path, model, EngineConfig(kv_cache_memory_mb=4, cpu_decode_linear=setting), device="cpu")
        forms = [m.forms for m in engine.runner.model.modules() if isinstance(m, Linear)]
        forms.append(engine.runner.model.lm_head_forms)
        natives = {f.native for f in forms}
        # "c": the kernel is timed, and where it won a bucket it is this library; "torch": never in.
        assert natives <= ({None, library} if setting == "c" else {None})
        assert setting == "c" or not any("c" in f.per_bucket for f in forms)
