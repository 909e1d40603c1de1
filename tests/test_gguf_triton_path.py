"""The CUDA loader's wiring of a GGUF file (engine/model/gguf_quant.py with a non-CPU device), taken here
on CPU tensors: every projection and the LM head become ``CudaQuantLinear`` over the file's own blocks
(the Triton kernel under the CPU interpreter), and the engine's greedy tokens equal those of the
dequantizing path (float32 weights, torch matmuls). The kernel's products are the dequantized weight's up
to float32 rounding (tests/test_quant_matmul_triton.py), far below the logit gaps of these prompts. On a
GPU: tests/gpu/test_gguf_cuda.py."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import torch
from gguf import GGMLQuantizationType

from engine.llm import LLM
from engine.quant.cuda_linear import CudaQuantLinear, cuda_linear_for
from engine.sampling.params import SamplingParams
from tests.gguf_factory import dequantizing, write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10], [300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def triton_on_cpu():
    """The CUDA branch of the loader with CPU as its device: what ``--device cuda`` puts in place."""
    return patch(
        "engine.model.gguf_quant.linear_for",
        lambda record, bias=None: cuda_linear_for(record, bias, torch.device("cpu"), torch.float32),
    )


def greedy(llm: LLM) -> list[list[int]]:
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_no_leak(llm.engine.block_manager)
    return got


def test_gguf_on_the_triton_kernel_generates_the_dequantized_tokens(tmp_path: Path) -> None:
    # one format: the wiring is the same for all, each format's kernel is tests/test_quant_matmul_triton.py's
    # (Q4_1: nibbles and the min term), and the interpreter takes minutes per model on a loaded machine
    qtype = GGMLQuantizationType.Q4_1
    gguf_file = write_gguf(tiny_model_dir("mistral"), "mistral", tmp_path / "tiny.gguf", qtype)
    with triton_on_cpu():
        llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, CudaQuantLinear)]
    assert len(kept) == 4 * len(model.layers) + 1  # every projection of every layer, and the head
    assert {m.type_name for m in kept} == {qtype.name}
    with dequantizing():
        plain = LLM(str(gguf_file), kv_cache_memory_mb=8)
    assert greedy(llm) == greedy(plain)
