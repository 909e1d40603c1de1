"""The engine on its CUDA kernels with an 8-bit KV pool, run on CPU under the Triton interpreter: the
model's layers call the Triton store and attention (``kernels.store_kv`` / ``kernels.paged_attention``
as they dispatch for CUDA tensors), so the runner, scheduler, prefix cache and block tables around them
are the engine's own.

- int8: the same greedy tokens as the CPU engine's int8 path (its own store and attention over the same
  format), the same pool bytes after the run, log-probabilities within float32 rounding of it.
- fp8: the same greedy tokens as a float32-KV engine whose store rounds K and V through torch's e4m3 cast
  (clamped at +-448): the values attention reads are the same, so only float32 rounding differs. The
  store here is the torch reference into the e4m3 pool, not the Triton store: the interpreter's float32
  -> e4m3 cast does not round to nearest (tests/test_kv_quant_triton.py), which moved log-probabilities by
  0.007 in this test; on a GPU the Triton store's rounding is checked against torch's
  (tests/gpu/test_gpu_kv_dtypes.py). (The engine on CPU refuses fp8 at start-up; that check is bypassed
  here for the kernels alone.)
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from unittest.mock import patch

import pytest
import torch

import kernels
from benchmarks.gpu.kv_dtypes import e4m3_rounded_store
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from kernels.triton.paged_attention import paged_attention_triton
from kernels.triton.store_kv import store_kv_reference, store_kv_triton
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [300, 301], [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
# block 8 and chunks of 8: the 19-token prompt is three chunks over three blocks, its last one partial;
# the third prompt shares the first's prefix (5 of its tokens): a prefix-cache hit is not possible
# below a block, so it recomputes them, beside the others' decode rows
ENGINE = dict(block_size=8, prefill_chunk_size=8, max_num_batched_tokens=16, kv_cache_memory_mb=4)
TORCH_CPU = dict(cpu_decode_attention="torch", cpu_prefill_attention="torch", cpu_layer_ops="torch")


def triton_kernels(stack: ExitStack, store=store_kv_triton) -> None:
    """The CUDA dispatch of kernels/__init__.py for CPU tensors (the step's CPU plan is not used)."""
    stack.enter_context(patch.object(kernels, "store_kv", store))
    stack.enter_context(
        patch.object(
            kernels,
            "paged_attention",
            lambda q, k, v, bt, cl, qs, scale, plan=None: paged_attention_triton(q, k, v, bt, cl, qs, scale),
        )
    )


def run(kv_cache_dtype: str, params: SamplingParams = GREEDY, **engine) -> tuple[list, torch.Tensor]:
    """Every completion's (tokens, log-probs), request by request, and the pool after the run."""
    llm = LLM(str(tiny_model_dir("llama")), kv_cache_dtype=kv_cache_dtype, **ENGINE, **engine)
    outputs = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
    assert_no_leak(llm.engine.block_manager)
    return [(o.token_ids, [e.logprob for e in o.logprobs]) for o in outputs], llm.engine.runner.kv_pool.tensor


def assert_same_tokens_close_logprobs(got, want, tol: float) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < tol


def test_int8_on_the_triton_kernels_equals_the_cpu_int8_engine():
    want, want_pool = run("int8")
    with ExitStack() as stack:
        triton_kernels(stack)
        got, got_pool = run("int8", **TORCH_CPU)
    assert got_pool.dtype == torch.int8 and torch.equal(got_pool, want_pool)  # the same bytes, scales included
    assert_same_tokens_close_logprobs(got, want, 1e-4)


@pytest.mark.parametrize("n", [1, 2])
def test_fp8_on_the_triton_kernels_equals_float32_kv_rounded_through_e4m3(n):
    """n = 2: each prompt's completions fork its blocks; the first decode step copies the shared partial
    block (the runner's copy-on-write, which moves an e4m3 pool as bytes: torch has no float8 index_copy_)."""
    params = dataclasses.replace(GREEDY, n=n)
    with patch.object(kernels, "store_kv", e4m3_rounded_store):
        want, _ = run("auto", params, **TORCH_CPU)
    with ExitStack() as stack:
        triton_kernels(stack, store=store_kv_reference)
        stack.enter_context(
            patch("engine.llm.kv_storage_dtype", lambda setting, model_dtype, device: torch.float8_e4m3fn)
        )
        got, got_pool = run("fp8", params, **TORCH_CPU)
    assert got_pool.dtype == torch.float8_e4m3fn and got_pool.view(torch.uint8).any()
    assert len(got) == n * len(PROMPTS)
    assert_same_tokens_close_logprobs(got, want, 1e-4)
