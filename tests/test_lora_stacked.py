"""The engine's LoRA product through the batched kernel (engine/lora/stacked.py, the CUDA path; the
Triton interpreter here) against the engine's torch path (LoRAStep's per-adapter groups, the CPU path)
and the kernel's torch reference, on every module of a tiny model with a mixed batch: base tokens and
three adapters of ranks 4, 8 (rsLoRA) and 16 that target different parts of the fused q/k/v and
gate/up projections (alpha q and v but not k, so its parts' columns are not its slices' order).

Then the whole engine on that path against PEFT's greedy tokens.

float32 throughout: the point is the layout (which rows and columns each slot's slices read), and in
float32 the three differ only by summation order (1e-5; the kernel's own dtypes: test_kernel_lora.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.llm import LLM
from engine.lora.adapter import PROJECTIONS, part_sizes
from engine.lora.manager import LoRALimits, LoRAManager
from engine.lora.stacked import StackedLoRA, use_lora_kernel
from engine.model.config import HFModelConfig
from engine.sampling.params import SamplingParams
from kernels.triton.lora_batched import lora_delta_reference, lora_delta_triton
from tests.lora_factory import peft_greedy, tiny_adapter_dir
from tests.model_factory import _root, tiny_model_dir

FAMILY = "llama"
NEW_TOKENS = 10
GAMMA = (16, 8, ("q_proj", "k_proj", "v_proj", "up_proj"))  # rank, alpha, targets


def gamma_adapter_dir(config: HFModelConfig):
    """A third adapter in PEFT's layout, written directly: every q/k/v part, up but not gate."""
    rank, alpha, targets = GAMMA
    gen = torch.Generator().manual_seed(11)
    sizes = part_sizes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for proj in targets:
            fused, part = PROJECTIONS[proj]
            out, inp = sizes[fused][part]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if 'up' in proj else 'self_attn'}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.3
    path = _root() / "lora-gamma-stacked"
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module")
def manager() -> LoRAManager:
    config = HFModelConfig.from_hf_dir(tiny_model_dir(FAMILY))
    manager = LoRAManager(config, LoRALimits(max_loras=3, max_lora_rank=16), torch.float32, "cpu")
    manager.add("alpha", str(tiny_adapter_dir("alpha", FAMILY)))
    manager.add("beta", str(tiny_adapter_dir("beta", FAMILY)))
    manager.add("gamma", str(gamma_adapter_dir(config)))
    return manager


def pinned(manager: LoRAManager, names: list[str]) -> list:
    """Each token row's adapter as a request pins it at admission ("" = the base model: None)."""
    return [manager.pin(name) if name else None for name in names]


def mixed_names(num_tokens: int) -> list[str]:
    gen = torch.Generator().manual_seed(num_tokens)
    choice = torch.randint(0, 4, (num_tokens,), generator=gen).tolist()
    return [["", "alpha", "beta", "gamma"][c] for c in choice]


@pytest.mark.parametrize("num_tokens", [37, 3])
def test_kernel_path_equals_torch_path_on_every_module(manager, num_tokens):
    names = mixed_names(num_tokens)
    step = manager.step(pinned(manager, names))
    assert step.stacked is None and not use_lora_kernel(manager.device)  # CPU: the torch path
    stacked = StackedLoRA(manager.config, manager.device).step(step.groups, num_tokens)
    base = torch.tensor([n == "" for n in names])
    gen = torch.Generator().manual_seed(5)
    for layer in range(manager.config.num_layers):
        for fused, parts in part_sizes(manager.config).items():
            key = (layer, fused)
            x = torch.randn(num_tokens, parts[0][1], generator=gen)
            y0 = torch.randn(num_tokens, sum(out for out, _ in parts), generator=gen)
            y_torch, y_kernel, y_reference = y0.clone(), y0.clone(), y0.clone()
            step.add_delta(key, x, y_torch)
            stacked.add_delta(key, x, y_kernel)
            lora_delta_reference(x, y_reference, stacked.stacks.weights(key), stacked.batch.slots)
            torch.testing.assert_close(y_kernel, y_torch, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
            torch.testing.assert_close(y_reference, y_torch, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
            assert torch.equal(y_kernel[base], y0[base])
            assert not torch.equal(y_kernel[~base], y0[~base])  # every module is some adapter's target


def test_an_adapter_sets_stacks_are_kept_across_steps(manager):
    stacked = StackedLoRA(manager.config, manager.device)
    first = stacked.step(manager.step(pinned(manager, ["alpha", "", "beta"])).groups, 3)
    again = stacked.step(
        manager.step(pinned(manager, ["beta", "beta", "alpha", ""])).groups, 4
    )  # same set, other order
    other = stacked.step(manager.step(pinned(manager, ["gamma"])).groups, 1)
    assert again.stacks is first.stacks and other.stacks is not first.stacks
    assert again.batch.slots.tolist() == [first.batch.slots[2], first.batch.slots[2], first.batch.slots[0], -1]


def test_engine_through_the_kernel_path_gives_pefts_greedy_tokens(monkeypatch):
    """The whole engine with the CUDA path's dispatch taken on CPU (the kernel under the interpreter):
    base and two adapters interleaved so every step mixes them, token for token PEFT's greedy output."""
    import engine.lora.manager

    launches = []
    monkeypatch.setattr(engine.lora.manager, "use_lora_kernel", lambda device: True)
    monkeypatch.setattr("engine.lora.stacked.lora_delta_triton", lambda *a: launches.append(lora_delta_triton(*a)))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 700, (n,), generator=gen).tolist() for n in (5, 37, 16)]
    names = ["", "alpha", "beta"]
    expected = {n: peft_greedy(FAMILY, n, prompts, NEW_TOKENS) for n in names}
    assert expected["alpha"] != expected[""] and expected["beta"] != expected[""]  # the adapters matter
    llm = LLM(
        str(tiny_model_dir(FAMILY)),
        block_size=8,
        prefill_chunk_size=16,
        kv_cache_memory_mb=8,
        enable_lora=True,
        lora_modules=[f"{n}={tiny_adapter_dir(n, FAMILY)}" for n in names[1:]],
        max_loras=2,
        max_lora_rank=8,
    )
    jobs = [(n, i) for i in range(len(prompts)) for n in names]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, lora_name=n) for n, _ in jobs]
    outputs = llm.generate([prompts[i] for _, i in jobs], params)
    for (name, i), out in zip(jobs, outputs):
        assert out.outputs[0].token_ids == expected[name][i], f"adapter {name!r} prompt {i}"
    assert launches  # the kernel ran
