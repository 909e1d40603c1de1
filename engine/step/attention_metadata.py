"""What one step's attention needs to find each token's KV in the paged pool.

Built once per step by the runner from the scheduled batch; shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import AttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [batch, max_blocks] int32: each request's blocks, padded with 0
    context_lens: torch.Tensor  # [batch] int32: tokens of context after this step (cached + new)
    query_start_loc: torch.Tensor  # [batch + 1] int32: request i's new tokens are [loc[i], loc[i+1])
    plan: AttentionPlan | None = None  # CPU only: how the torch path splits this batch (kernels.plan_attention)

    def __post_init__(self) -> None:
        assert self.query_start_loc.shape[0] == self.block_tables.shape[0] + 1
        assert self.context_lens.shape[0] == self.block_tables.shape[0]
