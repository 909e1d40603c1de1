"""benchmarks/gpu/kv_dtypes.py's arithmetic, without a model run: the greedy comparison, the bounds
``--check`` applies, and where the model comes from. (The run itself: ``python -m benchmarks.gpu.kv_dtypes
--device cpu``, minutes on two cores; on a GPU, scripts/gpu-check's kv_dtypes step.)"""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import kv_dtypes


def test_greedy_error_counts_equal_prompts_and_errors_up_to_the_first_divergence():
    base = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6], [-1.0, -2.0])]
    tested = [([1, 2, 9, 9], [-0.15, -0.2, -0.5, -9.0]), ([5, 6], [-1.0, -2.5])]
    got = kv_dtypes.greedy_error(base, tested)
    assert got["greedy_same_prompts"] == 1 and got["greedy_prompts"] == 2
    assert got["greedy_common_prefix_share"] == 4 / 6  # 2 of the first prompt's 4, both of the second's
    # the first prompt's positions 0, 1 and 2 (the diverging token's own log-prob counts), the second's 0, 1
    errors = [0.05, 0.0, 0.2, 0.0, 0.5]
    assert got["greedy_mean_abs_dlogprob"] == pytest.approx(sum(errors) / 5)
    assert got["greedy_max_abs_dlogprob"] == pytest.approx(0.5)


def within(mode: str) -> dict:
    """Figures exactly at every bound of ``mode``."""
    return {name: bound for name, (_, bound) in kv_dtypes.BOUNDS[mode].items()}


def test_check_names_each_figure_outside_its_bound():
    figures = {"int8": within("int8"), "fp8": within("fp8"), "auto": {}}
    assert kv_dtypes.out_of_bounds(figures) == []
    figures["fp8"]["bytes_ratio"] = 0.5625
    figures["int8"]["same_top1"] = 0.5
    assert kv_dtypes.out_of_bounds(figures) == ["int8 same_top1 0.5 not >= 0.98", "fp8 bytes_ratio 0.5625 not <= 0.5"]
    assert kv_dtypes.out_of_bounds({"int8": within("int8")}) == []  # a mode not run is not judged


def test_the_model_path_comes_from_the_environment_first(monkeypatch, tmp_path):
    monkeypatch.setenv(kv_dtypes.MODEL_ENV, str(tmp_path / "m.gguf"))
    assert kv_dtypes.smollm2_gguf() == tmp_path / "m.gguf"
    monkeypatch.delenv(kv_dtypes.MODEL_ENV)
    assert kv_dtypes.smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_fp8_rounded_store_holds_what_an_e4m3_pool_holds():
    key = torch.tensor([[[0.3, 1000.0, -449.0, 1e-4]]])
    k_cache, v_cache = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4)
    kv_dtypes.e4m3_rounded_store(key, -key, k_cache, v_cache, torch.tensor([1]))
    assert k_cache[0, 1, 0].tolist() == [0.3125, 448.0, -448.0, 0.0]  # 0.3 -> 0.3125; 1e-4 under 2^-9 / 2
    assert v_cache[0, 1, 0].tolist() == [-0.3125, -448.0, 448.0, -0.0]
    assert not k_cache[0, 0].any()
