"""GGUF weights kept quantized on CUDA (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: kernels/triton/quant_matmul.py through
engine/quant/cuda_linear.py), on a real GPU; skipped without CUDA (tests/gpu/conftest.py). Written and
checked under the CPU interpreter only (tests/test_quant_matmul_triton.py, tests/test_gguf_triton_path.py):
not yet run on a GPU.

- The kernel at a real model's sizes (SmolLM2-135M: K 576/1536, N up to 1536, and 2048 square; M 1 decode
  row to a prefill chunk) in fp32, bf16 and fp16, against ``gguf.quants.dequantize(bytes) @ x`` in
  float64. The bound is the interpreter tests' float32 one (the block's integers are exact in bf16/fp16, products of
  two bf16/fp16 numbers exact in float32), plus the rounding of the result to the activations' dtype
  (unit 2^-8 bf16, 2^-11 fp16) once.
- A tiny GGUF model (tests/gguf_factory.py) with ``--device cuda`` in float32: every projection and the
  head are ``CudaQuantLinear`` over the file's blocks, and the greedy tokens equal the CPU's dequantizing
  path (the CPU's C kernels quantize activations to int8 as llama.cpp does, so the Triton path, which
  does not, is compared with the path it computes: the dequantized weights in float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from configs.loader import load_config
from engine.llm import LLM
from engine.quant.cuda_linear import CudaQuantLinear
from engine.sampling.params import SamplingParams
from kernels.triton.quant_matmul import FORMATS, quant_matmul
from tests.gguf_factory import dequantizing, write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.test_quant_matmul_triton import file_blocks, hand_blocks, reference

OUTPUT_UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SHAPES = [(1, 1536, 576), (7, 576, 1536), (64, 1536, 576), (3, 2048, 2048)]  # (M, N, K)
CASES = [(t, m, n, k) for t, (per_block, _, _) in FORMATS.items() for m, n, k in SHAPES if k % per_block == 0]
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [300]]


@pytest.mark.parametrize("dtype", list(OUTPUT_UNIT))
@pytest.mark.parametrize(("type_name", "m", "n", "k"), CASES)
def test_gpu_quant_matmul_full_size(type_name: str, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m + n + k)
    made = [hand_blocks(rng, type_name, n, k)]
    if not type_name.endswith("_K"):  # gguf's quantizer writes no K-quants
        made.append(file_blocks(rng, type_name, n, k))
    for blocks in made:
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        exact, bound = reference(x.float().numpy(), blocks, type_name)
        got = quant_matmul(x.cuda(), torch.from_numpy(blocks).cuda(), type_name)
        assert got.dtype == dtype
        err = np.abs(got.double().cpu().numpy() - exact)
        allowed = bound + OUTPUT_UNIT[dtype] * (np.abs(exact) + bound)
        assert (err <= allowed).all(), f"max error {err.max():.3e}"


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert_no_leak(llm.engine.block_manager)
    return got


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gpu_gguf_model_kept_quantized_generates_the_dequantized_tokens(qtype, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model_dir("mistral"), "mistral", tmp_path / "tiny.gguf", qtype)
    config = load_config(None, env={}, overrides={"model.dtype": "float32", "engine.kv_cache_memory_mb": 64})
    cuda = LLM(str(gguf_file), config=config, device="cuda")
    kept = [m for m in cuda.engine.runner.model.modules() if isinstance(m, CudaQuantLinear)]
    assert len(kept) == 4 * len(cuda.engine.runner.model.layers) + 1
    assert all(m.blocks.is_cuda and m.blocks.dtype == torch.uint8 for m in kept)
    with dequantizing():
        cpu = LLM(str(gguf_file), config=config, device="cpu")
    assert greedy(cuda) == greedy(cpu)
