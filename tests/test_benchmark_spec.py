"""The served speculative decoding comparison's pieces (benchmarks/serve/spec_systems.py): its chat
workloads on the SmolLM2 tokenizer, the three systems of the plan, llama-server's speculation flags and
the four headline ratios from known runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.engine.spec_workloads import passages
from benchmarks.peers.llama_server import LlamaConfig
from benchmarks.serve import plan as P
from benchmarks.serve import workloads as W
from benchmarks.serve.report import Report, streams_load
from benchmarks.serve.spec_systems import LLAMA_SPEC_FLAGS, SPEC, SPEC_STREAMS, spec_headlines
from tests.test_benchmark_llama import _run


def test_spec_levels_are_chat_prompts_fresh_at_each_level():
    from transformers import AutoTokenizer

    from benchmarks.engine.spec_workloads import smollm2_checkpoint

    levels = W.spec_levels("spec_copy", (1, 4), rounds=2, min_requests=3, output_len=64)
    assert [(c, len(rs)) for c, rs in levels] == [(1, 3), (4, 8)]  # max(2c, 3)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    texts = [tokenizer.decode(r.prompt_token_ids) for _, rs in levels for r in rs]
    # Every copy prompt holds its own passage (11 passages, in order), inside the chat template.
    for text, passage in zip(texts, passages(11)):
        assert passage in text and text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert len(set(texts)) == len(texts)  # no level replays a prompt another cached
    for _, requests in levels:
        assert [r.index for r in requests] == list(range(len(requests)))
        assert {r.output_len for r in requests} == {64}
    free = W.spec_levels("spec_free", (1,), rounds=1, min_requests=2, output_len=8)
    assert "lighthouse keeper" in tokenizer.decode(free[0][1][0].prompt_token_ids)


def test_plan_runs_speculation_on_and_off_and_llama_servers_own(tmp_path):
    for quick in (True, False):
        by_name = {s.name: s for s in P.plan(quick).systems}
        on, off, llama = by_name["coloc-spec"], by_name["coloc-nospec"], by_name["llama-spec"]
        assert json.loads(on.sections["engine"]["speculative_config"]) == SPEC
        assert "speculative_config" not in off.sections["engine"]
        assert {k: v for k, v in on.sections["engine"].items() if k != "speculative_config"} == off.sections["engine"]
        assert (on.num_prefill, on.num_decode, off.num_prefill, off.num_decode) == (0, 1, 0, 1)
        assert llama.llama.extra == LLAMA_SPEC_FLAGS and llama.gguf == ""  # the checked f32 conversion
        for spec in (on, off, llama):
            assert spec.workloads == ("spec",) and spec.stream_levels == SPEC_STREAMS == (1, 4, 16)
        assert all("spec" not in s.workloads for s in by_name.values() if s not in (on, off, llama))
    argv = LlamaConfig(2, 1, False, 1024, LLAMA_SPEC_FLAGS).argv(Path("/bin/llama-server"), Path("m.gguf"), 8080)
    assert argv[-2:] == ["--spec-type", "ngram-simple"]
    narrowed = P.select(P.plan(True), ["coloc-spec", "llama-spec"], ["spec"])
    assert [(s.name, s.workloads) for s in narrowed.systems] == [("coloc-spec", ("spec",)), ("llama-spec", ("spec",))]


def test_spec_headlines_from_known_runs():
    report = Report()
    report.runs = [
        _run("coloc-spec", "spec_copy", streams_load(1), 90.0, 0.01, 0.1),
        _run("coloc-nospec", "spec_copy", streams_load(1), 45.0, 0.02, 0.1),
        _run("llama-spec", "spec_copy", streams_load(1), 60.0, 0.015, 0.1),
        _run("coloc-spec", "spec_free", streams_load(1), 48.0, 0.02, 0.1),
        _run("coloc-nospec", "spec_free", streams_load(1), 50.0, 0.02, 0.1),
        _run("coloc-spec", "spec_free", streams_load(16), 300.0, 0.05, 1.0),
        _run("coloc-nospec", "spec_free", streams_load(4), 200.0, 0.05, 1.0),  # not the 16-stream run
    ]
    assert spec_headlines(report) == pytest.approx(
        {"spec_copy_1": 2.0, "spec_free_1": 0.96, "spec_free_16": math.nan, "spec_vs_llama_copy_1": 1.5},
        nan_ok=True,
    )
