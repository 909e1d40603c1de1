"""The C linear (kernels/cpu_linear.c) against a float64 product, in every build the decode-attention
tests build (each vector width, and without OpenMP), at row counts that cross its 4-, 2- and 1-row
tiles; the same bits on one thread and two; the shapes it takes; and the engine's switch for it."""

from __future__ import annotations

import pytest
import torch

from configs.schema import EngineConfig, ModelConfig
from engine.cpu_linear import Linear
from engine.llm import build_engine
from kernels import cpu_native
from tests.model_factory import tiny_model_dir

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 30]


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
        out = any_build.linear(x, weight, bias)
        assert out.shape == (rows, shape[1]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"{rows} rows")


def test_c_linear_reads_a_strided_input(library):
    x, weight, _ = case(6, 64, 64, seed=1)
    wide = torch.randn(6, 128)
    wide[:, :64] = x
    strided = wide[:, :64]  # row stride 128: the MLP's down_proj input
    torch.testing.assert_close(library.linear(strided, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_c_linear_gives_the_same_bits_on_one_thread_and_two(any_build):
    x, weight, bias = case(13, 512, 1024, seed=5)
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
    # Inputs a multiple of the vector width (4, 8 or 16 floats), outputs a multiple of 64 (its task).
    assert [n for n in (0, 32, 64, 100, 128, 192, 32000) if library.supports_linear(64, n)] == [64, 128, 192, 32000]
    assert [k for k in (0, 16, 18, 64, 896, 1001) if library.supports_linear(k, 64)] == [16, 64, 896]


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
