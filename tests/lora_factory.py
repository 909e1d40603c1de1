"""Random-weight PEFT LoRA adapters for the tiny test models, and PEFT's own greedy output under them.

``lora_B`` is initialised randomly (PEFT starts it at zero, which would make every adapter the base).
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import torch

from tests.model_factory import _root, tiny_model_dir

# name -> (rank, alpha, rsLoRA, target modules): different ranks, scalings and targets, fused parts alone
ADAPTERS = {
    "alpha": (4, 8, False, ("q_proj", "v_proj", "down_proj")),
    "beta": (8, 16, True, ("k_proj", "o_proj", "gate_proj", "up_proj")),
}  # fmt: skip


def _base(family: str):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(family)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@functools.cache
def tiny_adapter_dir(name: str, family: str = "llama", seed: int = 0) -> Path:
    """A PEFT adapter directory ``ADAPTERS[name]`` for ``tiny_model_dir(family)``."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, rslora, targets = ADAPTERS[name]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(_base(family), config)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}-{seed}".encode()))  # not hash(): salted per process
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:  # lora_A and lora_B both random, sized so the delta matters
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    out = _root() / f"lora-{family}-{name}-{seed}"
    model.save_pretrained(out)
    return out


def peft_greedy(family: str, adapter: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter``) greedy continuations, one prompt at a time, EOS disabled."""
    from peft import PeftModel

    model = _base(family)
    if adapter:
        model = PeftModel.from_pretrained(model, tiny_adapter_dir(adapter, family)).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
