"""``model.load_format: dummy`` (vLLM's ``--load-format dummy``): random weights made directly on the
target device in the target dtype, no checkpoint files read; only ``config.json`` is needed.

For measuring speed and memory at a real model's shape (an 8B-class model on one GPU) without its
checkpoint. The output is meaningless text. As vLLM does, matrices are uniform in [-1e-3, 1e-3];
norm weights are 1, so activations keep their scale through 32 layers instead of vanishing or
overflowing in bfloat16 (the kernels then see the value ranges of a real model, roughly).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import HFModelConfig
from engine.model.model import CausalLM

DUMMY_RANGE = 1e-3


def fill_dummy(lm: CausalLM, config: HFModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
    """Every parameter of ``lm`` (built on the meta device) materialised on ``device`` in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in lm.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if module is lm and name == "lm_head" and config.tie_word_embeddings:
                continue  # the embedding's Parameter, below
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if value.ndim == 1 and "norm" in type(module).__name__.lower():
                value.fill_(1.0)
            elif value.ndim == 1:  # biases
                value.zero_()
            else:
                value.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
    if config.tie_word_embeddings:
        lm._parameters["lm_head"] = lm.embed_tokens
    still_meta = [name for name, param in lm.named_parameters() if param.is_meta]
    assert not still_meta, f"parameters left unmade: {still_meta}"
