"""scripts/gpu-check's parts that need no GPU: its arguments, the report it writes, the clear exit
without CUDA, and the size of what the device tool would carry (benchmarks/gpu/check.py)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu import check as gpu_check

WHEEL_SET_MIB = 12  # scripts/gpu-wheels.txt measured 10.2 MiB (xgrammar + tvm-ffi 4.4, pydantic-core 2.2)


def test_steps_are_chosen_by_name_and_unknown_ones_refused(capsys):
    assert gpu_check.parse_args([]).step_names == ["tests_gpu", "kernels", "pd_parity", "engine_throughput"]
    assert gpu_check.parse_args(["--steps", "kernels, pd_parity"]).step_names == ["kernels", "pd_parity"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--steps", "kernels,warp_drive"])
    assert "unknown step(s) warp_drive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget-s", "0"])


def test_report_is_written_and_the_exit_says_why(tmp_path):
    """Here (no CUDA): exit 3 and status no_cuda, no step run. On a GPU host the deadline is spent
    before the first step, so every step is reported skipped rather than run."""
    rc = gpu_check.main(["--out", str(tmp_path), "--budget-s", "0.001", "--wheels", str(tmp_path / "none")])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["deps"] == dict.fromkeys(gpu_check.NEEDED, "present")  # this venv has them all
    assert report["structured_output"] is True and report["wheels"]["count"] == 0
    if torch.cuda.is_available():
        assert rc == 1 and {r["status"] for r in report["steps"].values()} == {"skipped"}
    else:
        assert rc == 3 and report["status"] == "no_cuda" and report["steps"] == {}
        assert report["cuda"]["available"] is False
    assert "status" in (tmp_path / "gpu-check.log").read_text()


def test_the_tree_leaves_room_for_the_wheels():
    """The device tool carries at most 64 MiB: the tree (tracked and untracked-not-ignored files) plus
    the wheel folder. A tree grown past what is left for the wheels would stop the GPU run."""
    assert gpu_check.carried_bytes([]) + (WHEEL_SET_MIB << 20) < gpu_check.CARRY_LIMIT
