"""Every system a benchmark compares runs on one device in one dtype (benchmarks/common/device_choice.py):
pdserve's engine would take CUDA bfloat16 on a GPU host while a plainly loaded transformers baseline
stays on CPU in float32, and the comparison would measure the hardware."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.device_choice import BenchDevice, choose_device
from benchmarks.engine.throughput import parse_args, pdserve_config
from benchmarks.peers import hf_baseline
from benchmarks.serve.run import served_device
from tests.model_factory import tiny_model_dir


def test_default_follows_the_engine_rule_on_either_host():
    assert choose_device(None, None, cuda_available=True) == BenchDevice("cuda", "bfloat16")
    assert choose_device(None, None, cuda_available=False) == BenchDevice("cpu", "float32")
    assert choose_device(None, "auto", cuda_available=True) == BenchDevice("cuda", "bfloat16")


def test_explicit_device_and_dtype_are_kept():
    assert choose_device("cpu", None, cuda_available=True) == BenchDevice("cpu", "float32")
    assert choose_device("cuda", "float32", cuda_available=True) == BenchDevice("cuda", "float32")
    assert choose_device("cpu", "bfloat16", cuda_available=False) == BenchDevice("cpu", "bfloat16")


def test_cuda_without_a_gpu_and_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="no CUDA device"):
        choose_device("cuda", None, cuda_available=False)
    with pytest.raises(ValueError, match="int8"):
        choose_device("cpu", "int8", cuda_available=False)


def test_command_line_reaches_the_choice():
    args = parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    assert choose_device(args.device, args.dtype, cuda_available=True) == BenchDevice("cpu", "bfloat16")
    args = parse_args([])
    assert choose_device(args.device, args.dtype, cuda_available=True) == BenchDevice("cuda", "bfloat16")


def test_serve_benchmark_baseline_follows_the_served_dtype():
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert served_device(["model.dtype=float16", "engine.block_size=8"]) == BenchDevice(expected_device, "float16")
    assert served_device([]).device == expected_device


def test_both_systems_load_in_the_chosen_dtype():
    """The same BenchDevice gives transformers' weights and pdserve's weights and KV pool one dtype and
    device (bfloat16 on CPU here: a dtype neither side would pick by itself on this host)."""
    from engine.llm import LLM

    bench = BenchDevice("cpu", "bfloat16")
    path = tiny_model_dir("llama")
    hf = hf_baseline.load_hf_model(path, bench)
    assert {(p.dtype, p.device.type) for p in hf.parameters()} == {(torch.bfloat16, "cpu")}
    config = pdserve_config(bench, {"block_size": 8, "num_kv_blocks": 16})
    assert config.model.dtype == "bfloat16" and config.engine.block_size == 8
    runner = LLM(str(path), config=config, device=bench.device).engine.runner
    assert {(p.dtype, p.device.type) for p in runner.model.parameters()} == {(torch.bfloat16, "cpu")}
    assert runner.kv_pool.tensor.dtype == torch.bfloat16 and runner.kv_pool.tensor.device.type == "cpu"
