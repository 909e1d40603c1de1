"""benchmarks/gpu/kernels.py's parts that need no GPU: the decode shapes the issue asks for, their
parsing, and that timings come from triton.testing.do_bench (no host sync per iteration)."""

from __future__ import annotations

import argparse

import pytest
import triton.testing

from benchmarks.gpu import kernels


def test_decode_shapes_are_the_issues():
    assert kernels.DECODE_SHAPES == [(64, 2048), (8, 16384), (256, 512)]
    assert kernels.parse_shapes("64x2048, 8x16384") == [(64, 2048), (8, 16384)]
    for bad in ("64", "0x2048", "64x-1", "", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            kernels.parse_shapes(bad)


def test_time_ms_is_do_bench_median(monkeypatch):
    calls = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        calls.append((warmup, rep, return_mode))
        fn()
        return 0.25

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    ran = []
    assert kernels.time_ms(lambda: ran.append(1)) == 0.25
    assert ran == [1] and calls == [(25, 100, "median")]


def test_without_cuda_the_benchmark_says_so(capsys, monkeypatch):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    assert kernels.main(["--decode-shapes", "8x16384"]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
