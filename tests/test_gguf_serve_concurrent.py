"""A quantized GGUF under a real ``pdserve serve`` (gateway + one decode worker that prefills its own prompts,
as ``coloc-q8`` in benchmarks/serve/gguf_systems.py runs) with several concurrent streams: every request
completes, each with the single engine's tokens on the same file, and no KV block stays in use.

The weights stay Q8_0 in the quantized kernels. Their ``int`` form quantizes activations per row, so a
row's result does not depend on the other rows of its step, while the ``panel`` form (float) rounds
otherwise: both processes read one forms file set to ``int`` at every bucket (the forms cache,
kernels/cpu/forms_cache.py, at one thread count), and every step stays under the last bucket's rows,
so the served steps, whichever requests they batch, compute what the single engine's do."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from gguf import GGMLQuantizationType

from engine.llm import LLM
from engine.quant import forms
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.gguf_factory import write_gguf
from tests.model_factory import tiny_model_dir

MAX_TOKENS = 16
THREADS = len(os.sched_getaffinity(0))  # what `pdserve serve` gives its one worker (cluster/serve.py)
PROMPTS = [" ".join(["once upon a time"] * n) for n in (1, 2, 3, 4, 2, 1)]  # 6 streams, under 128 rows a step


def _all_int_forms(cache_dir) -> None:
    """Every stored quantized forms file set to ``int`` at every bucket."""
    files = [
        p
        for p in cache_dir.glob("forms-*.json")
        if all(set(v) == {"per_bucket"} for v in json.loads(p.read_text()).values())
    ]
    assert files, "the single engine stored its quantized forms"
    for path in files:
        stored = json.loads(path.read_text())
        path.write_text(json.dumps({g: {**v, "per_bucket": ["int"] * len(v["per_bucket"])} for g, v in stored.items()}))


def _stream(url: str, model: str, prompt: str) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    text, chunks = "", 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                chunks += 1
    return text, chunks


def test_concurrent_streams_on_a_quantized_gguf_all_complete_with_the_engines_tokens(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(tmp_path / "forms"))
    monkeypatch.delenv("PDSERVE_RETIME_CPU_FORMS", raising=False)
    monkeypatch.setattr(forms, "_picked", {})
    gguf_file = write_gguf(tiny_model_dir("qwen2"), "qwen2", tmp_path / "tiny-q8.gguf", GGMLQuantizationType.Q8_0)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        LLM(str(gguf_file), kv_cache_memory_mb=8)  # times the forms and stores them
        _all_int_forms(tmp_path / "forms")
        monkeypatch.setattr(forms, "_picked", {})
        single = LLM(str(gguf_file), kv_cache_memory_mb=8)  # reads them back: int everywhere
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].text for o in single.generate(PROMPTS, greedy)]
    finally:
        torch.set_num_threads(threads)
    serve = ServeProcess(
        gguf_file,
        tmp_path,
        num_prefill=0,
        env={"PDSERVE_CPU_FORMS_CACHE_DIR": str(tmp_path / "forms")},
        engine={"kv_cache_memory_mb": 8},
    )
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _stream(serve.url, str(gguf_file), p), PROMPTS))
        workers = serve.wait_idle()  # no KV block left in use, the integrity check clean
        log = "".join(serve.log)
    finally:
        code = serve.stop()
    assert code == 0, "".join(serve.log[-30:])
    assert "quantized matmul forms found in the cache" in log and "heartbeats stopped" not in log
    assert [text for text, _ in answers] == expected
    assert all(0 < chunks <= MAX_TOKENS for _, chunks in answers)
    assert [w["id"] for w in workers] == ["decode-0"]
