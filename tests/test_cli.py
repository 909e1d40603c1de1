"""The ``pdserve`` command as a user runs it: make a model, generate from it, get clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, timeout=300)


def test_make_model_then_generate_matches_the_library(tmp_path: Path) -> None:
    out = tmp_path / "qwen3-tiny"
    made = pdserve("make-model", "--family", "qwen3", "--size", "tiny", "--out", str(out), "--seed", "3")
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]

    run = pdserve("generate", "--model", str(out), "--prompt", "hello world", "--max-tokens", "6", "--ignore-eos")
    assert run.returncode == 0, run.stderr
    llm = LLM(str(out))
    [expected] = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert "(length, 6 tokens)" in run.stdout
    assert run.stdout.rstrip("\n").endswith(expected.outputs[0].text)


def test_generate_rejects_bad_sampling_value_by_name(tmp_path: Path) -> None:
    run = pdserve("generate", "--model", str(tmp_path), "--prompt", "x", "--top-p", "1.5")
    assert run.returncode == 2
    assert "top_p must be in (0, 1], got 1.5" in run.stderr


def test_unknown_command_lists_the_commands() -> None:
    run = pdserve("frobnicate")
    assert run.returncode == 2
    assert "unknown command 'frobnicate'" in run.stderr and "make-model" in run.stderr
