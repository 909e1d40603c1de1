"""A BF16 or F16 GGUF (as ``convert_hf_to_gguf.py --outtype bf16|f16`` writes one) stays 16-bit on CPU:
every projection and the LM head run kernels/cpu/half.c from the file's own rows, nothing is widened to
float32 at load, the load log says so, and greedy tokens equal those of the dequantizing path (the same
weights widened to float32 at load, x unrounded): BF16's activations split in two bf16 halves hold x to
16 significant bits, so the two paths differ by float32 rounding only. Written in the test from a tiny
random Mistral (llama.cpp's q/k row order) and a tiny Qwen2 (biases on q/k/v), served through the gateway too."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType

from engine.llm import LLM
from engine.model.loader import load_model
from engine.quant.apply import PROJECTIONS, dequantize, quantized_modules
from engine.sampling.params import SamplingParams
from kernels.cpu.half import HalfLibrary
from tests.cluster_harness import ServeProcess
from tests.gguf_factory import dequantizing, write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_no_leak(llm.engine.block_manager)
    return got


@pytest.mark.parametrize("family", ("mistral", "qwen2"))
@pytest.mark.parametrize("qtype", ("BF16", "F16"))
def test_16_bit_file_runs_its_own_rows_and_greedy_equals_the_dequantized(family, qtype, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model_dir(family), family, tmp_path / "m.gguf", GGMLQuantizationType[qtype])
    with patch("engine.model.gguf_quant.log") as log:
        llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    layers = len(model.layers)
    kept, floats = log.info.call_args.args[2], log.info.call_args.args[4]  # keep_quantized's one line
    assert kept == f"{qtype} x{4 * layers}, {qtype} LM head x1" and floats == "none"
    modules = quantized_modules(model)
    assert len(modules) == 4 * layers + 1 and model.quantized_head in modules
    assert {m.qweight.type_name for m in modules} == {qtype} and all(isinstance(m.lib, HalfLibrary) for m in modules)
    # 2 bytes a weight, and exactly the file's values (the dequantizing loader's float32 weights, before an
    # engine's timed forms may keep only the C linear's copy of them)
    with dequantizing():
        plain_model = load_model(gguf_file)[0]
        plain = LLM(str(gguf_file), kv_cache_memory_mb=8)
    for layer, plain_layer in zip(model.layers, plain_model.layers):
        for path in PROJECTIONS:
            record = layer.get_submodule(path).qweight
            assert record.rows.shape[1] == 2 * record.in_features
            assert torch.equal(dequantize(record), plain_layer.get_submodule(path).weight), path
    # decode steps as one C call (engine/model/decode_step.py) through half.c's entry points
    fused = model.fused_decode
    assert fused is not None and isinstance(fused.quant, HalfLibrary)
    with patch.object(fused, "run", wraps=fused.run) as fused_run:
        got = _greedy(llm)
    assert fused_run.call_count > 0
    assert got == _greedy(plain)


def test_served_bf16_file_answers_the_dequantized_paths_text(tmp_path: Path) -> None:
    """Through the gateway, a prefill and a decode worker (real processes): the kernels on both sides."""
    gguf_file = write_gguf(tiny_model_dir("qwen2"), "qwen2", tmp_path / "tiny-bf16.gguf", GGMLQuantizationType.BF16)
    with dequantizing():
        plain = LLM(str(gguf_file), kv_cache_memory_mb=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = plain.generate(["Once upon a time"], greedy)[0].outputs[0].text
    serve = ServeProcess(gguf_file, tmp_path, engine={"kv_cache_memory_mb": 8}, gateway={"local_prefill_max_tokens": 0})
    try:
        body = {"model": str(gguf_file), "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0}
        answer = httpx.post(f"{serve.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
    finally:
        code = serve.stop()
    assert code == 0, "".join(serve.log[-30:])
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected and answer.json()["usage"]["completion_tokens"] == 12
    assert any("BF16 x" in line and "kept quantized" in line for line in serve.log), "".join(serve.log[-30:])


@pytest.mark.parametrize("qtype", ("BF16", "F16"))
def test_panel_form_computes_the_kernels_function(qtype) -> None:
    """The ``panel`` form (float32 panel, torch's matmul) multiplies x as the kernel reads it (kernel_inputs.py):
    the two forms differ by float32 sum order only, so the timed pick per row count never moves a token."""
    from engine.quant.linear import quantized_linear
    from engine.quant.weight import QuantizedWeight
    from kernels.cpu import half
    from tests.test_half_kernels import U, reference

    g = torch.Generator().manual_seed(3)
    w16 = (torch.randn(37, 576, generator=g) * 0.05).to(torch.bfloat16 if qtype == "BF16" else torch.float16)
    weight = QuantizedWeight(qtype, w16.view(torch.uint8).contiguous(), 576)
    bias, x = torch.randn(37, generator=g), torch.randn(70, 576, generator=g) * 3
    expect, size, n = reference(qtype, w16, x, bias)
    for form in ("int", "panel"):
        got = quantized_linear(x, weight, half.load(), form, bias).double()
        assert ((got - expect).abs() <= n * U / (1 - n * U) * size).all(), form
