"""Runs one scheduled step: builds the flattened varlen batch, runs the model, samples.

A step is a list of (sequence, token range) pairs — prefill chunks and single decode tokens in one
shape. For sequence i the step computes ``token_ids[c_i : c_i + n_i]`` with ``c_i`` its computed
tokens; its K/V land in the pool through ``block_table`` and its queries attend to ``c_i + n_i`` keys.

    flattened tokens:  | seq 0: n_0 tokens | seq 1: n_1 | ... |
    query_start_loc:   0                  n_0          n_0+n_1 ...
"""

from __future__ import annotations

import torch

import kernels
from engine.attention_metadata import AttentionMetadata
from engine.kv_pool import KVPool
from engine.lora_manager import LoRAManager, LoRAStep
from engine.model import CausalLM
from engine.prompt_logprobs import record_prompt_logprobs
from engine.sampler import Sampler, SamplerOutput
from engine.scheduled_batch import ScheduledBatch
from kernels.cpu_native import NativeLibrary


def supports_native_decode(library: NativeLibrary, num_heads: int, kv_pool: KVPool) -> bool:
    """Whether the C decode kernel runs this model's attention: float32 K/V on CPU, a query group and
    head size it has a compiled copy for."""
    layout = kv_pool.layout
    return (
        kv_pool.tensor.device.type == "cpu"
        and layout.dtype == torch.float32
        and library.supports(num_heads // layout.kv_heads, layout.head_dim)
    )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        sampler: Sampler | None = None,
        native_decode: NativeLibrary | None = None,
        lora: LoRAManager | None = None,
    ):
        """``native_decode``: the C decode kernel (CPU only), for a model and pool it supports
        (``supports_native_decode``); None keeps decode attention on the torch path. ``lora``: the
        adapters requests may name (the model must have LoRA enabled); None: base only."""
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler or Sampler()
        self.native_decode = native_decode
        self.lora = lora
        self.block_size = kv_pool.layout.block_size
        self.device = kv_pool.tensor.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Compute the batch's tokens; sample one token for each of ``batch.sample_seqs``; record the
        prompt logprobs of the sequences that ask (engine/prompt_logprobs.py)."""
        self._copy_blocks(batch.block_copies)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_pool, meta, self._lora_step(batch))  # [num_tokens, hidden]
        record_prompt_logprobs(self.model.compute_logits, hidden, batch, meta.query_start_loc)
        last_token_rows = meta.query_start_loc[1:].long() - 1  # [batch]: each seq's last new token
        rows = last_token_rows[torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden[rows])  # [num_samples, vocab]
        return self.sampler(logits, batch.sample_seqs)

    def _lora_step(self, batch: ScheduledBatch) -> LoRAStep | None:
        if self.lora is None or not any(seq.params.lora_name for seq in batch.seqs):
            return None
        pinned = [self._pinned_lora(seq.params) for seq in batch.seqs]
        adapters = [a for a, n in zip(pinned, batch.num_new_tokens) for _ in range(n)]
        return self.lora.step(adapters)  # [num_tokens] rows, in the order _prepare flattens them

    def _pinned_lora(self, params):
        if params.lora_name and params.lora_adapter is None:  # admitted without LLMEngine.lora_error
            params.lora_adapter = self.lora.pin(params.lora_name)
        return params.lora_adapter

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        # Copy-on-write of a shared partial block: whole blocks, every layer, K and V.
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        pool = self.kv_pool.tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        pool.index_copy_(2, dst, pool.index_select(2, src))

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        seqs, counts = batch.seqs, batch.num_new_tokens
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, counts):
            input_ids.extend(seq.token_ids[start : start + n])
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs]

        device = self.device
        block_tables = torch.tensor(tables, dtype=torch.int32, device=device)  # [batch, max_blocks]
        count_t = torch.tensor(counts, dtype=torch.int32, device=device)
        start_t = torch.tensor(starts, dtype=torch.int32, device=device)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=device)
        torch.cumsum(count_t, 0, out=query_start_loc[1:])
        # Position of every new token: its sequence's start plus its offset inside the chunk.
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=device), count_t)  # [num_tokens]
        offsets = torch.arange(seq_of_token.shape[0], device=device) - query_start_loc[seq_of_token]
        positions = (start_t[seq_of_token] + offsets).long()  # [num_tokens]
        blocks = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        context_lens = start_t + count_t
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            plan=None
            if device.type == "cuda"
            else kernels.plan_attention(
                block_tables, context_lens, query_start_loc, self.kv_pool.tensor[0, 0], self.native_decode
            ),
        )
        return torch.tensor(input_ids, dtype=torch.long, device=device), positions, meta
