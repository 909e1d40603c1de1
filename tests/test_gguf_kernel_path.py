"""A GGUF loaded as ``pdserve serve`` loads it runs its projections and LM head on the quantized kernels,
and every product they make inside the engine is the float product of the file's own weights to within
what the format's 8-bit activation blocks allow.

The bound, per output: each activation block of 32 is rounded to d * q with d = max|x| / 127, so each
value moves by at most d / 2 = max|x| / 254, and output n moves by at most
sum over blocks b of (max|x_b| / 254) * sum over i in b of |W[n, i]|, plus float32 rounding of the sums
(tests/test_quant_kernels.py's allowance). The weights are the file's, decoded by llama.cpp's own
``gguf.quants.dequantize``, and the activations are the real hidden states of a prompt (forward hooks on
every quantized module, the head's included), so the check covers the logits too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, dequantize

from engine.llm import LLM
from engine.quant.apply import quantized_modules
from engine.sampling.params import SamplingParams
from tests.gguf_factory import write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

PROMPTS = [list(range(20, 60)), [5, 6, 7]]


def _activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[rows, out]: the most rounding x [rows, in] to int8 blocks of 32 can move x @ w.T (w [out, in])."""
    amax = np.abs(x.reshape(x.shape[0], -1, 32)).max(axis=2)  # [rows, in / 32]
    half_step = np.repeat(amax / 254, 32, axis=1)  # [rows, in]
    return half_step @ np.abs(w).T


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
def test_every_product_is_the_float_product_within_the_activation_bound(qtype: str, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model_dir("mistral"), "mistral", tmp_path / "m.gguf", GGMLQuantizationType[qtype])
    llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    modules = quantized_modules(model)
    assert len(modules) == 4 * len(model.layers) + 1 and model.quantized_head in modules  # + the LM head
    assert {m.qweight.type_name for m in modules} == {qtype}
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
        w = dequantize(module.qweight.rows.numpy(), GGMLQuantizationType[qtype]).astype(np.float64)
        x64 = x.reshape(-1, module.in_features).double().numpy()
        exact = x64 @ w.T + (0 if module.bias is None else module.bias.double().numpy())
        error = np.abs(y.reshape(exact.shape).double().numpy() - exact)
        sums = 2e-5 * np.abs(exact).max() * np.sqrt(module.in_features / 256)
        bound = _activation_bound(x64, w) + sums
        assert (error <= bound).all(), f"{module}: error {error.max():.3g} over its bound"
        worst = max(worst, float((error / bound).max()))
    assert worst > 0  # the kernels did round: the kernel path ran, not a float fallback
    print(f"{qtype}: {len(seen)} products, the largest error {worst:.2f} of its bound")
