"""``pdserve serve --model x.gguf`` as a new user runs it: a GGUF file (a tiny qwen2 written as llama.cpp
writes it, F32 so the served tokens can be compared exactly), one prefill and one decode worker behind
the gateway (real processes), a completion through the OpenAI API. The text is the single engine's on
the same file (the disaggregated path changes no token), and the model is listed under the name it was
given. The real SmolLM2 Q4_1 file is served by ``python -m benchmarks.serve`` (benchmarks/serve/gguf_systems.py)."""

from __future__ import annotations

import httpx

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.cluster_harness import ServeProcess
from tests.gguf_factory import write_gguf
from tests.model_factory import tiny_model_dir

PROMPT = "Once upon a time"
MAX_TOKENS = 12


def test_serve_a_gguf_and_complete(tmp_path) -> None:
    gguf_file = write_gguf(tiny_model_dir("qwen2"), "qwen2", tmp_path / "tiny-qwen2.gguf")
    single = LLM(str(gguf_file), kv_cache_memory_mb=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = single.generate([PROMPT], greedy)[0].outputs[0].text
    serve = ServeProcess(gguf_file, tmp_path, engine={"kv_cache_memory_mb": 8}, gateway={"local_prefill_max_tokens": 0})
    try:
        body = {"model": str(gguf_file), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        answer = httpx.post(f"{serve.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120).json()
        models = httpx.get(f"{serve.url}/v1/models", timeout=10).json()
    finally:
        code = serve.stop()
    assert code == 0, "".join(serve.log[-30:])
    assert answer["choices"][0]["text"] == expected and answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert [m["id"] for m in models["data"]] == [str(gguf_file)]
