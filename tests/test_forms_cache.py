"""The CPU matmul forms kept on disk (kernels/cpu/forms_cache.py): a process that finds its machine's picks
for a model takes them without timing, and anything else it finds there (a stale build's forms, a
broken file, no way to write) falls back to timing, as a start without the cache would."""

from __future__ import annotations

import json

import pytest

from engine.model import cpu_linear
from engine.model.cpu_linear import FORMS, ROW_BUCKETS
from engine.model.loader import load_model
from kernels.cpu import build as cpu_build
from kernels.cpu import forms_cache
from kernels.cpu import native as cpu_native
from tests.model_factory import tiny_model_dir


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """A fresh cache directory and a fresh process (no picks in memory); the list grows by one per timing."""
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_RETIME_CPU_FORMS", raising=False)
    monkeypatch.setattr(cpu_linear, "_picked", {})
    done = []
    real = cpu_linear._timed_picks
    monkeypatch.setattr(cpu_linear, "_timed_picks", lambda *args: done.append(args[3]) or real(*args))
    return done


def choose(native):
    return load_model(tiny_model_dir("qwen2"))[0].choose_cpu_matmul_forms(native)


def new_process(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_picked", {})


def test_the_next_process_takes_the_stored_picks_without_timing(timings, monkeypatch, tmp_path):
    native = cpu_native.load()
    first = choose(native)
    [path] = tmp_path.glob("forms-*.json")
    stored = json.loads(path.read_text())
    assert stored == {k: {"per_bucket": list(f.per_bucket), "prefill": f.prefill} for k, f in first.items()}
    new_process(monkeypatch)
    assert choose(native) == first and len(timings) == 1
    new_process(monkeypatch)
    without_c = choose(None)  # other kernels: another file, timed
    assert len(timings) == 2 and len(list(tmp_path.glob("forms-*.json"))) == 2
    assert all(forms.native is None for forms in without_c.values())


def test_retime_times_again_and_rewrites(timings, monkeypatch, tmp_path):
    native = cpu_native.load()
    choose(native)
    [path] = tmp_path.glob("forms-*.json")
    path.write_text(
        json.dumps(
            {k: {"per_bucket": ["plain"] * len(ROW_BUCKETS), "prefill": "plain"} for k in json.loads(path.read_text())}
        )
    )
    new_process(monkeypatch)
    assert all(f.per_bucket == ("plain",) * len(ROW_BUCKETS) for f in choose(native).values())  # taken as stored
    monkeypatch.setenv("PDSERVE_RETIME_CPU_FORMS", "1")
    new_process(monkeypatch)
    again = choose(native)
    assert len(timings) == 2
    assert json.loads(path.read_text()) == {
        k: {"per_bucket": list(f.per_bucket), "prefill": f.prefill} for k, f in again.items()
    }


@pytest.mark.parametrize(
    "damage", ["not json", "unknown form", "a list for a form", "missing group", "extra group", "bucket count"]
)
def test_a_file_that_does_not_fit_this_build_is_timed_again_and_rewritten(timings, monkeypatch, tmp_path, damage):
    native = cpu_native.load()
    first = choose(native)
    [path] = tmp_path.glob("forms-*.json")
    stored = json.loads(path.read_text())
    group = next(iter(stored))
    if damage == "not json":
        path.write_text('{"q_proj": ')
    else:
        if damage == "unknown form":
            stored[group]["per_bucket"][0] = "amx"
        elif damage == "a list for a form":
            stored[group]["per_bucket"][0] = ["c"]
        elif damage == "missing group":
            del stored[group]
        elif damage == "extra group":
            stored["gate_up"] = stored[group]
        else:
            stored[group]["per_bucket"].append("plain")
        path.write_text(json.dumps(stored))
    new_process(monkeypatch)
    again = choose(native)
    assert len(timings) == 2 and set(again) == set(first)
    assert forms_cache.load(path, list(first), FORMS, len(ROW_BUCKETS)) is not None  # rewritten whole


def test_a_cache_that_cannot_be_written_leaves_timing_at_each_start(timings, monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(blocked / "cpu-forms"))  # under a file: no mkdir
    native = cpu_native.load()
    choose(native)
    new_process(monkeypatch)
    choose(native)
    assert len(timings) == 2 and list(tmp_path.iterdir()) == [blocked]


def test_the_key_separates_machines_builds_and_shapes(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(tmp_path))
    key = (("q_proj", 2, (64, 64)), 3, 2)
    base = forms_cache.path_for(key, "cpu_native-aaaa.so")
    assert base.parent == tmp_path and base == forms_cache.path_for(key, "cpu_native-aaaa.so")
    assert forms_cache.path_for(key, "cpu_native-bbbb.so") != base
    assert forms_cache.path_for(key, None) != base
    assert forms_cache.path_for((("q_proj", 2, (64, 64)), 3, 4), "cpu_native-aaaa.so") != base
    monkeypatch.setattr(cpu_build, "cpu_identity", lambda: "another CPU")
    assert forms_cache.path_for(key, "cpu_native-aaaa.so") != base
