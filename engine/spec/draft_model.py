"""The draft of ``method: "draft_model"``: a checkpoint sharing the target's tokenizer, or the target's own
first N layers ("self:N", self-speculation), each with its own paged KV pool.

Naming: vLLM and SGLang ship no layer-skip draft (vLLM's LayerSkip pull request #18994 was closed
unmerged); transformers calls it an early exit (``assistant_early_exit=N``: "the assistant model will be
the model itself with early exit"). pdserve takes it where vLLM takes the draft, in ``"model"``:
``{"method": "draft_model", "model": "self:4", "num_speculative_tokens": 4}``: the target's embedding,
its layers 0..3, then its final norm and LM head. The layers are the target's own modules (no second
copy of the weights); their K/V go to the draft's pool, as a separate model's would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv.pool import KVPool
from engine.lora.manager import NO_LORA
from engine.model.model import CausalLM, check_slots
from engine.step.attention_metadata import AttentionMetadata

SELF_PREFIX = "self:"


class DraftModelError(ValueError):
    """A draft that cannot serve this target; the message names the draft and the mismatch."""


class EarlyExitDraft:
    """The target's first ``num_layers`` layers, then its final norm and head: CausalLM's interface
    (``__call__``, ``compute_logits``) for the draft's ModelRunner."""

    def __init__(self, target: CausalLM, num_layers: int):
        assert 1 <= num_layers < len(target.layers), num_layers
        self.target = target
        self.num_layers = num_layers

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_pool: KVPool,  # the draft's pool: num_layers layers
        meta: AttentionMetadata,
        lora=None,  # drafts run the base weights: verification keeps the output the adapter's
    ) -> torch.Tensor:  # [T, hidden], before the final norm
        t = self.target
        if t.lora_ref is not None:
            t.lora_ref.step = NO_LORA
        x = F.embedding(input_ids, t.embed_tokens)  # [T, hidden]
        cos, sin = t.rotary.cos_sin(positions, x.dtype)
        if t.native_layer_ops:
            check_slots(meta.slot_mapping, kv_pool.layer(0)[0])
        residual = None
        for index in range(self.num_layers):
            x, residual = t.layers[index](x, residual, cos, sin, kv_pool.layer(index), meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        return self.target.compute_logits(hidden)


def self_draft_layers(model_field: str, num_target_layers: int) -> int | None:
    """N of a ``"self:N"`` draft; None for a checkpoint path. Raises DraftModelError for a bad N."""
    if not model_field.startswith(SELF_PREFIX):
        return None
    text = model_field[len(SELF_PREFIX) :]
    if not text.isdigit() or not 1 <= int(text) < num_target_layers:
        raise DraftModelError(
            f"draft model {model_field!r}: N must be an integer in 1..{num_target_layers - 1} "
            f"(the target has {num_target_layers} layers)"
        )
    return int(text)


def check_same_vocabulary(path: str, draft_vocab: int, target_vocab: int) -> None:
    """A draft proposes token ids the target verifies: both must index the same vocabulary."""
    if draft_vocab != target_vocab:
        raise DraftModelError(
            f"draft model {path!r} has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: "
            "a draft must share the target's tokenizer"
        )
