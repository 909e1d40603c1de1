"""The batched LoRA kernel on CUDA (kernels/triton/lora_batched.py): at full size against a per-token float64
computation and its torch reference, and the engine on CUDA (which dispatches its LoRA deltas to the
kernel) against PEFT on CUDA, token for token. Skipped without CUDA (tests/gpu/conftest.py).

Tolerances are relative to each output's magnitude (tests/test_kernel_lora.py): on CUDA casts round
to nearest, so the half types are off by at most half a unit at each of two rounding points (the
shrink and y): 2e-3 for float16 (2 * 2^-11), 1e-2 for bfloat16 (2 * 2^-9 = 4e-3, with room for the
float32 summation order over 14336 columns); float32 runs tl.dot without TF32, 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from configs.loader import load_config
from engine.llm import LLM
from engine.lora.stacked import use_lora_kernel
from engine.sampling.params import SamplingParams
from kernels.triton.lora_batched import lora_delta_reference, lora_delta_triton, plan_lora_batch
from tests.lora_factory import tiny_adapter_dir
from tests.model_factory import tiny_model_dir
from tests.test_kernel_lora import assert_close_relative, make_weights, per_token_float64

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (hidden, slices, ranks per slot and slice): Llama-3-8B's fused q/k/v and its down projection
SHAPES = {
    "qkv": (4096, (4096, 1024, 1024), [[8, 8, 8], [16, 0, 16], [32, 32, 32], [128, 128, 0]]),
    "down": (14336, (4096,), [[16], [64], [8]]),
}


def full_size_slots(num_slots: int) -> torch.Tensor:
    """64 decode tokens over every slot and the base, a 600-token prefill chunk of slot 1, 100 base."""
    gen = torch.Generator().manual_seed(num_slots)
    slots = torch.cat(
        [torch.randint(-1, num_slots, (64,), generator=gen), torch.full((600,), 1), torch.full((100,), -1)]
    )
    return slots[torch.randperm(len(slots), generator=gen)].cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_lora_kernel_full_size(dtype, shape):
    hidden, slices, ranks = SHAPES[shape]
    scalings = [2.0, 0.5, 1.0, 0.125][: len(ranks)]
    weights = make_weights(dtype, 7, hidden, slices, ranks, scalings, device="cuda")
    slots = full_size_slots(len(ranks))
    x = torch.randn(len(slots), hidden, device="cuda").to(dtype)
    y0 = torch.randn(len(slots), sum(slices), device="cuda").to(dtype)
    y_kernel, y_reference = y0.clone(), y0.clone()

    lora_delta_triton(x, y_kernel, weights, plan_lora_batch(slots, len(ranks)))
    lora_delta_reference(x, y_reference, weights, slots)

    expected, magnitude = per_token_float64(x, y0, weights, slots)
    assert_close_relative(y_kernel, expected, magnitude, TOLERANCE[dtype])
    assert_close_relative(y_reference, expected, magnitude, TOLERANCE[dtype])
    assert torch.equal(y_kernel[slots < 0], y0[slots < 0])


@torch.inference_mode()
def peft_greedy_cuda(adapter: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, attn_implementation="eager"
    )
    if adapter:
        model = PeftModel.from_pretrained(model, tiny_adapter_dir(adapter, "llama"))
    model = model.to("cuda").eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_gpu_engine_with_adapters_equals_peft_token_for_token(monkeypatch):
    """float32 on CUDA: base and two adapters in every step through the kernel, as PEFT generates."""
    assert use_lora_kernel(torch.device("cuda"))
    launches = []
    monkeypatch.setattr("engine.lora.stacked.lora_delta_triton", lambda *a: launches.append(lora_delta_triton(*a)))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 700, (n,), generator=gen).tolist() for n in (5, 37, 16, 90)]
    names = ["", "alpha", "beta"]
    config = load_config(
        None,
        env={},
        overrides={
            "model.dtype": "float32",
            "engine.block_size": 16,
            "engine.prefill_chunk_size": 32,
            "engine.kv_cache_memory_mb": 64,
            "lora.enable_lora": True,
            "lora.lora_modules": [f"{n}={tiny_adapter_dir(n, 'llama')}" for n in names[1:]],
            "lora.max_loras": 2,
            "lora.max_lora_rank": 8,
        },
    )
    llm = LLM(str(tiny_model_dir("llama")), config=config, device="cuda")
    jobs = [(n, i) for i in range(len(prompts)) for n in names]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, lora_name=n) for n, _ in jobs]
    outputs = llm.generate([prompts[i] for _, i in jobs], params)
    expected = {n: peft_greedy_cuda(n, prompts, 16) for n in names}
    assert expected["alpha"] != expected[""] and expected["beta"] != expected[""]
    for (name, i), out in zip(jobs, outputs):
        assert out.outputs[0].token_ids == expected[name][i], f"adapter {name!r} prompt {i}"
    assert launches
