"""scripts/gpu-check's parts that need no GPU: its arguments, the report it writes, the clear exit
without CUDA, and the size of what the device tool would carry (benchmarks/gpu/check.py)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu import check as gpu_check

WHEEL_SET_MIB = 12  # scripts/gpu-wheels.txt measured 10.2 MiB (xgrammar + tvm-ffi 4.4, pydantic-core 2.2)


def test_steps_are_chosen_by_name_and_unknown_ones_refused(capsys):
    assert gpu_check.parse_args([]).step_names == ["tests_gpu", "kernels", "scale", "pd_parity"]
    assert gpu_check.parse_args(["--steps", "engine_throughput"]).step_names == ["engine_throughput"]
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


def test_the_default_plan_fits_five_minutes_with_its_installs(tmp_path):
    args = gpu_check.parse_args([])
    plan = gpu_check.plan(args.step_names, args.budget_s, tmp_path)
    assert plan["fits"] and plan["total_s"] <= args.budget_s <= 300
    assert [s["name"] for s in plan["steps"]] == ["tests_gpu", "kernels", "scale", "pd_parity"]
    over = gpu_check.plan(["tests_gpu", "kernels", "scale", "pd_parity", "engine_throughput"], 300, tmp_path)
    assert not over["fits"]


def test_dry_run_lists_the_plan_and_every_step_starts(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("tests_gpu", "kernels", "scale", "pd_parity"):
        assert f"{name}" in out
    assert "DOES NOT START" not in out and "fits" in out and "OVER BUDGET" not in out


def test_gpu_tests_write_one_result_line_each_as_they_end(tmp_path):
    """tests/gpu/conftest.py: a line per test the moment it ends (here every one is skipped: no CUDA)."""
    import os
    import subprocess
    import sys

    results = tmp_path / "tests_gpu.jsonl"
    env = {**os.environ, "PDSERVE_GPU_RESULTS": str(results)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    done = subprocess.run(argv, cwd=gpu_check.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    collected = subprocess.run(
        argv + ["--collect-only"], cwd=gpu_check.ROOT, env=env, capture_output=True, text=True, timeout=300
    ).stdout
    assert len(lines) == len({line["test"] for line in lines}) == collected.count("::")
    outcomes = {line["outcome"] for line in lines}
    assert outcomes <= {"passed", "failed"} if torch.cuda.is_available() else outcomes == {"skipped"}
