"""The engine with quantized projections (engine/quant/) against the same engine whose projections hold
those very weights dequantized to float32: greedy tokens equal, the sampled tokens' log-prob gap small
(printed: mean and max). Formats with block 32 on the tiny random model; the K-quants (block 256) on the
small one. Also ``--quantization int8`` through the config, and its quantizer's round trip."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

import engine.llm
from cluster.make_model import build_tokenizer
from engine.llm import LLM
from engine.model.loader import load_model
from engine.quant.apply import PROJECTIONS, dequantize, quantize_projections, quantized_modules
from engine.quant.int8 import dequantize_int8, quantize_int8
from engine.quant.kquants import quantize_q4_k, quantize_q6_k
from engine.quant.linear import QuantLinear
from engine.quant.weight import QuantizedWeight
from engine.sampling.params import SamplingParams
from tests.invariants import assert_no_leak
from tests.model_factory import _root, tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
NEAR_TIE = 0.05  # nats between the reference's top two tokens: a step where either pick is the model's


def _gguf_quantizer(type_name: str):
    """float weight -> its GGUF blocks: llama.cpp's Python quantizer where the gguf package has one, else
    engine/quant/kquants.py's (checked against gguf's decoding in tests/test_quant_formats.py)."""

    def make(weight: torch.Tensor) -> QuantizedWeight:
        if type_name in K_QUANTIZERS:
            return K_QUANTIZERS[type_name](weight)
        rows = quantize(weight.float().numpy(), GGMLQuantizationType[type_name])
        return QuantizedWeight(type_name, torch.from_numpy(np.ascontiguousarray(rows)), weight.shape[1])

    return make


@functools.cache
def _records(family: str, size: str, type_name: str) -> dict[tuple[int, str], QuantizedWeight]:
    model, _ = load_model(_model_dir(family, size))
    make = quantize_int8 if type_name == "I8" else _gguf_quantizer(type_name)
    return {(i, p): make(layer.get_submodule(p).weight) for i, layer in enumerate(model.layers) for p in PROJECTIONS}


@functools.cache
def _model_dir(family: str, size: str) -> str:
    """``tiny`` (hidden 64: block-32 formats); ``k256``: the tiny llama made 256 wide, as the K-quants'
    256-value blocks need (the ``small`` model would do, at ten times the test's time)."""
    if size == "tiny":
        return str(tiny_model_dir(family))
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = _root() / f"{family}-{size}"
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=768, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    return str(out)


def _engine(monkeypatch, path: str, records, quantized: bool) -> LLM:
    """An engine over ``path`` whose projections are ``records``: kept quantized, or dequantized to float."""

    def load(*args, **kwargs):
        model, config = load_model(*args, **kwargs)
        if quantized:
            quantize_projections(model, _Lookup(model, records))
        else:
            for (i, p), record in records.items():
                module = model.layers[i].get_submodule(p)
                module.weight = torch.nn.Parameter(dequantize(record), requires_grad=False)
        return model, config

    monkeypatch.setattr(engine.llm, "load_model", load)
    return LLM(path, block_size=8, prefill_chunk_size=64, max_num_batched_tokens=256, kv_cache_memory_mb=32)


class _Lookup:
    """A quantizer that hands back the prepared record of each projection, in ``quantize_projections``' order."""

    def __init__(self, model, records):
        self._order = iter(records[(i, p)] for i in range(len(model.layers)) for p in PROJECTIONS)

    def __call__(self, weight: torch.Tensor) -> QuantizedWeight:
        record = next(self._order)
        assert record.shape == tuple(weight.shape)
        return record


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 17, 40, 130)]


@pytest.mark.parametrize(
    "type_name,size",
    [
        *[(t, "tiny") for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "I8")],
        ("Q4_K", "k256"),
        ("Q6_K", "k256"),
    ],
)
def test_quantized_engine_greedy_equals_dequantized_engine(monkeypatch, type_name, size):
    path = _model_dir("llama", size)
    records = _records("llama", size, type_name)
    quant = _engine(monkeypatch, path, records, quantized=True)
    assert len(quantized_modules(quant.engine.runner.model)) == len(records)
    assert all(m.qweight.type_name == type_name for m in quantized_modules(quant.engine.runner.model))
    prompts = _prompts(quant.engine.runner.model.config.vocab_size)
    got = quant.generate(prompts, GREEDY)
    assert_no_leak(quant.engine.block_manager)
    ref = _engine(monkeypatch, path, records, quantized=False).generate(prompts, GREEDY)
    gaps, ties = [], 0
    for i, (g, r) in enumerate(zip(got, ref)):
        g_out, r_out = g.outputs[0], r.outputs[0]
        for step, (a, b) in enumerate(zip(g_out.logprobs, r_out.logprobs)):
            if a.token_id != b.token_id:
                # int8 activation blocks (as llama.cpp's) move logits by ~1e-3: they may flip a near tie, and the
                # continuations differ from there on; anything else is a wrong kernel
                margin = b.top[0][1] - b.top[1][1]
                assert margin < NEAR_TIE, f"{type_name}: prompt {i} diverges at {step} (reference margin {margin:.3f})"
                ties += 1
                break
            gaps.append(abs(a.logprob - b.logprob))
    print(f"{type_name} ({size}): logprob gap mean {np.mean(gaps):.2e} max {np.max(gaps):.2e}, near ties {ties}")
    assert np.max(gaps) < NEAR_TIE and len(gaps) >= len(prompts) * GREEDY.max_tokens // 2


def test_int8_quantizer_round_trip_and_bound():
    w = torch.randn(45, 96) * torch.logspace(-3, 1, 45).unsqueeze(1)  # rows of very different scales
    w[3] = 0  # an all-zero row keeps scale 0 and stays zero
    record = quantize_int8(w)
    back = dequantize_int8(record)
    # each row within half a step of its own scale: per-channel, not one scale for the whole matrix
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((back - w).abs() <= step / 2 + 1e-7)
    assert torch.equal(back[3], torch.zeros(96))
    # the C decoding of I8 rows agrees with this one
    assert torch.equal(dequantize(record), back)


def test_quantization_int8_flag_quantizes_every_projection():
    llm = LLM(str(tiny_model_dir("llama")), kv_cache_memory_mb=8)  # the float engine, for the reference text
    cfg_llm = LLM(str(tiny_model_dir("llama")), config=_config_with(quantization="int8"))
    modules = quantized_modules(cfg_llm.engine.runner.model)
    assert len(modules) == 4 * llm.engine.runner.model.config.num_layers and all(
        isinstance(m, QuantLinear) for m in modules
    )
    assert {m.qweight.type_name for m in modules} == {"I8"}


def _config_with(**model_fields):
    from configs.loader import load_config

    return load_config(
        None, overrides={**{f"model.{k}": v for k, v in model_fields.items()}, "engine.kv_cache_memory_mb": "8"}
    )
