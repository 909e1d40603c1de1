"""``pdserve serve --model x.gguf`` as a new user runs it: the real SmolLM2 Q4_1 file, one prefill and one
decode worker behind the gateway (real processes), chat through the OpenAI API. The answer is the one
the single engine gives on the same file (the disaggregated path changes no token), and says Paris; the
model is listed under the name it was given."""

from __future__ import annotations

import httpx

from configs.model_source import resolve_model
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from gateway.text.tokenizer import Tokenizer
from tests.cluster_harness import ServeProcess
from tests.gguf_factory import SMOLLM2_GGUF

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def test_serve_a_gguf_and_chat(tmp_path) -> None:
    tokenizer = Tokenizer(resolve_model(str(SMOLLM2_GGUF)))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    single = LLM(str(SMOLLM2_GGUF), kv_cache_memory_mb=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = tokenizer.decode(single.generate([prompt], greedy)[0].outputs[0].token_ids)
    del single
    serve = ServeProcess(
        SMOLLM2_GGUF, tmp_path, engine={"kv_cache_memory_mb": 64}, gateway={"local_prefill_max_tokens": 0}
    )
    try:
        body = {
            "model": str(SMOLLM2_GGUF),
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }
        answer = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=120).json()
        models = httpx.get(f"{serve.url}/v1/models", timeout=10).json()
    finally:
        code = serve.stop()
    assert code == 0, "".join(serve.log[-30:])
    text = answer["choices"][0]["message"]["content"]
    assert text == expected and "Paris" in text, (text, expected)
    assert [m["id"] for m in models["data"]] == [str(SMOLLM2_GGUF)]
