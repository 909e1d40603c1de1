"""A GGUF loaded as ``pdserve serve`` loads it runs its projections and LM head on the quantized kernels,
and every product they make inside the engine is the float product of the file's own weights to within
what the kernels' rounding of activations allows.

The bound, per output: each activation block of 16 is rounded to d * q with d = max|x| / 127, and what that
left is rounded the same way, so each value moves by at most max|x| / 254 / 254 (and an ulp), and output n
by at most the sum over blocks b of (max|x_b| / 254 / 254) * sum over i in b of |W[n, i]|, plus float32
rounding of the sums (tests/quant_blocks.py, tests/test_quant_kernels.py's allowance). The weights are the file's, decoded by llama.cpp's own
``gguf.quants.dequantize``, and the activations are the real hidden states of a prompt (forward hooks on
every quantized module, the head's included), so the check covers the logits too."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from gguf import GGMLQuantizationType, dequantize

from configs.loader import load_config
from engine.llm import LLM
from engine.quant.apply import quantized_modules
from engine.quant.parts import QuantParts
from engine.sampling.params import SamplingParams
from tests.gguf_factory import write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.quant_blocks import activation_bound

PROMPTS = [list(range(20, 60)), [5, 6, 7]]


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
def test_every_product_is_the_float_product_within_the_activation_bound(qtype: str, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model_dir("mistral"), "mistral", tmp_path / "m.gguf", GGMLQuantizationType[qtype])
    llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    modules = quantized_modules(model)
    assert len(modules) == 4 * len(model.layers) + 1 and model.quantized_head in modules  # + the LM head
    assert {m.qweight.type_name for m in modules} == {qtype}
    _check_every_product(llm, modules, qtype)


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_1"))
def test_with_int16_activations_every_product_is_within_the_two_term_bound(qtype: str, tmp_path: Path) -> None:
    """``model.quant_activations: int16``: a second int8 term carries what the first rounding left, so each
    product is within 1/254 of the one-term bound (tests/quant_blocks.py) of the float product."""
    gguf_file = write_gguf(tiny_model_dir("mistral"), "mistral", tmp_path / "m.gguf", GGMLQuantizationType[qtype])
    overrides = {"model.quant_activations": "int16", "engine.kv_cache_memory_mb": 8}
    llm = LLM(str(gguf_file), config=load_config(None, overrides=overrides))
    modules = quantized_modules(llm.engine.runner.model)
    assert {m.lib.act_terms for m in modules} == {2}
    _check_every_product(llm, modules, qtype, terms=2)


def test_a_q4_k_m_mix_runs_every_projection_on_the_kernels(tmp_path: Path) -> None:
    """As llama-quantize's Q4_K_M writes SmolLM2: q/k/o/gate/up in Q5_0, v in Q8_0. Each layer's qkv runs
    a kernel per format (engine/quant/parts.py), nothing is float, and the products hold the same bound."""
    per_tensor = {"attn_v": GGMLQuantizationType.Q8_0}
    hf_dir = tiny_model_dir("mistral")
    gguf_file = write_gguf(hf_dir, "mistral", tmp_path / "m.gguf", GGMLQuantizationType.Q5_0, per_tensor)
    with patch("engine.model.gguf_quant.log") as log:
        llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    layers = len(model.layers)
    kept, floats = log.info.call_args.args[2], log.info.call_args.args[4]  # keep_quantized's one line
    assert kept == f"Q5_0 x{3 * layers}, Q5_0+Q8_0 (a kernel each) x{layers}, Q5_0 LM head x1" and floats == "none"
    qkv = [layer.self_attn.qkv_proj for layer in model.layers]
    assert all(isinstance(m, QuantParts) for m in qkv)
    q_k = model.config.hidden_size + model.config.num_kv_heads * model.config.head_dim
    assert {tuple((r.qweight.type_name, r.out_features) for r in m.runs) for m in qkv} == {
        (("Q5_0", q_k), ("Q8_0", model.config.num_kv_heads * model.config.head_dim))
    }
    modules = [m for m in quantized_modules(model) if not any(m in p.runs for p in qkv)] + qkv
    assert len(modules) == 4 * layers + 1
    _check_every_product(llm, modules, None)


def _float_weight(module) -> np.ndarray:
    """The float64 [out, in] weight a quantized module stands for, as ``gguf.quants.dequantize`` decodes it."""
    runs = module.runs if isinstance(module, QuantParts) else [module]
    return np.concatenate(
        [dequantize(r.qweight.rows.numpy(), GGMLQuantizationType[r.qweight.type_name]) for r in runs]
    ).astype(np.float64)


def _check_every_product(llm: LLM, modules: list, qtype: str | None, terms: int = 1) -> None:
    """Greedy generation with a hook on every module: each product within the activation bound (activations
    in ``terms`` int8 terms) of the float product of its weight as the file holds it."""
    seen: list[tuple] = []
    # copies: the layers go on to work in place (SwiGLU over gate/up's output, the residual adds)
    hooks = [m.register_forward_hook(lambda m, args, y: seen.append((m, args[0].clone(), y.clone()))) for m in modules]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for hook in hooks:
        hook.remove()
    assert_no_leak(llm.engine.block_manager)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert {id(m) for m, _, _ in seen} == {id(m) for m in modules}  # every module ran at least once
    worst = 0.0
    for module, x, y in seen:
        w = _float_weight(module)
        x64 = x.reshape(-1, module.in_features).double().numpy()
        exact = x64 @ w.T + (0 if module.bias is None else module.bias.double().numpy())
        error = np.abs(y.reshape(exact.shape).double().numpy() - exact)
        sums = 2e-5 * np.abs(exact).max() * np.sqrt(module.in_features / 256)
        bound = activation_bound(x64, w, terms) + sums
        assert (error <= bound).all(), f"{module}: error {error.max():.3g} over its bound"
        worst = max(worst, float((error / bound).max()))
    assert worst > 0  # the kernels did round: the kernel path ran, not a float fallback
    print(f"{qtype or 'mixed'}: {len(seen)} products, the largest error {worst:.2f} of its bound")
