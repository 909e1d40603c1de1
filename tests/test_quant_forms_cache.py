"""The quantized weights' matmul forms kept on disk (engine/quant/forms.py through kernels/cpu/forms_cache.py):
a second start on the same machine takes the stored picks without timing (a file of an older build that
still carries the constant ``"prefill": "panel"`` too); a changed key (shapes, format,
thread count, kernels' build) times again; a file others may write is not trusted."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.model.cpu_linear import ROW_BUCKETS
from engine.quant import forms
from engine.quant.int8 import quantize_int8
from engine.quant.linear import QUANT_FORMS, QuantLinear
from kernels.cpu import quant as cpu_quant


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """A fresh cache directory and process; the list grows by the groups of each timing pass."""
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_RETIME_CPU_FORMS", raising=False)
    monkeypatch.setattr(forms, "_picked", {})
    done = []
    real = forms._timed
    monkeypatch.setattr(forms, "_timed", lambda groups, repeats: done.append(sorted(groups)) or real(groups, 0))
    return done


def _modules(out_features: int = 96, layers: int = 2) -> list[QuantLinear]:
    lib = cpu_quant.load()
    assert lib is not None, "the quantized C kernels build on this machine"
    g = torch.Generator().manual_seed(0)
    return [
        QuantLinear(quantize_int8(torch.randn(n, 64, generator=g)), None, lib)
        for _ in range(layers)
        for n in (out_features, 64)
    ]


def test_second_start_reads_the_cache_and_a_changed_key_times_again(timings, monkeypatch, tmp_path):
    first = forms.choose_quant_forms(_modules())
    assert timings == [["I8 64x64", "I8 96x64"]]
    [path] = tmp_path.glob("forms-*.json")
    stored = json.loads(path.read_text())
    assert stored == {g: {"per_bucket": list(picks)} for g, picks in first.items()}  # no prefill pick: there is none
    assert all(set(p) <= set(QUANT_FORMS) and len(p) == len(ROW_BUCKETS) for p in first.values())

    monkeypatch.setattr(forms, "_picked", {})  # the next process
    modules = _modules()
    assert forms.choose_quant_forms(modules) == first and len(timings) == 1
    assert [m.per_bucket for m in modules] == [first[f"I8 {m.out_features}x64"] for m in modules]

    monkeypatch.setattr(forms, "_picked", {})
    forms.choose_quant_forms(_modules(out_features=128))  # another shape: another key, timed
    assert len(timings) == 2 and len(list(tmp_path.glob("forms-*.json"))) == 2

    monkeypatch.setattr(forms, "_picked", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        forms.choose_quant_forms(_modules())  # another thread count: timed
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 3

    monkeypatch.setattr(forms, "_picked", {})
    monkeypatch.setenv("PDSERVE_RETIME_CPU_FORMS", "1")
    forms.choose_quant_forms(_modules())
    assert len(timings) == 4


def test_a_file_written_with_the_old_constant_prefill_entry_is_still_read(timings, monkeypatch, tmp_path):
    first = forms.choose_quant_forms(_modules())
    [path] = tmp_path.glob("forms-*.json")
    old = {g: {"per_bucket": list(picks), "prefill": "panel"} for g, picks in first.items()}  # before it was dropped
    path.write_text(json.dumps(old))
    monkeypatch.setattr(forms, "_picked", {})
    modules = _modules()
    assert forms.choose_quant_forms(modules) == first and len(timings) == 1  # read, not timed again
    assert [m.per_bucket for m in modules] == [first[f"I8 {m.out_features}x64"] for m in modules]


def test_a_file_others_may_write_is_removed_and_timed_again(timings, monkeypatch, tmp_path):
    forms.choose_quant_forms(_modules())
    [path] = tmp_path.glob("forms-*.json")
    os.chmod(path, 0o666)
    monkeypatch.setattr(forms, "_picked", {})
    forms.choose_quant_forms(_modules())
    assert len(timings) == 2
    assert not os.stat(path).st_mode & 0o022  # rewritten as this user's own


def test_a_shared_writable_directory_is_tightened(timings, monkeypatch, tmp_path):
    os.chmod(tmp_path, 0o777)
    forms.choose_quant_forms(_modules())
    assert not os.stat(tmp_path).st_mode & 0o077 and len(list(tmp_path.glob("forms-*.json"))) == 1
