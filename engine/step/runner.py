"""Runs one scheduled step: builds the flattened varlen batch, runs the model, samples.

A step is a list of (sequence, token range) pairs — prefill chunks and single decode tokens in one
shape. For sequence i the step computes ``token_ids[c_i : c_i + n_i]`` with ``c_i`` its computed
tokens; its K/V land in the pool through ``block_table`` and its queries attend to ``c_i + n_i`` keys.

    flattened tokens:  | seq 0: n_0 tokens | seq 1: n_1 | ... |
    query_start_loc:   0                  n_0          n_0+n_1 ...

A speculating sequence's token and k drafts (engine/spec/) reach attention as 1 + k decode rows, each
its own query over the keys up to it, when no prompt chunk shares the step: every row of the step then
decodes one token, so the step takes the C decode path (one fused call for every layer,
engine/model/decode_step.py) as a plain decode step does. Each layer stores all rows' K/V before any row
attends, so draft j's row sees the drafts before it. As one chunk of 1 + k the step took the prefill
path layer by layer.

    verify rows of B (k = 2, c computed):   block table   context
                                  t_c       B's           c + 1
                                  d_1       B's           c + 2
                                  d_2       B's           c + 3
"""

from __future__ import annotations

import itertools

import torch

import kernels
from engine.kv.pool import KVPool
from engine.lora.manager import LoRAManager, LoRAStep
from engine.model.model import CausalLM
from engine.sampling.prompt_logprobs import record_prompt_logprobs
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sched.batch import ScheduledBatch
from engine.spec.verify import sample_with_drafts
from engine.step.attention_metadata import AttentionMetadata
from kernels.cpu.native import NativeLibrary


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
        native_prefill: NativeLibrary | None = None,
    ):
        """``native_decode``: the C decode kernel (CPU only), for a model and pool it supports
        (``supports_native_decode``); None keeps decode attention on the torch path. ``native_prefill``:
        the C prefill kernel likewise (the same support rule); None keeps SDPA. ``lora``: the
        adapters requests may name (the model must have LoRA enabled); None: base only."""
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler or Sampler()
        self.native_decode = native_decode
        self.native_prefill = native_prefill
        self.lora = lora
        self.block_size = kv_pool.layout.block_size
        self.device = kv_pool.tensor.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Compute the batch's tokens; sample one token for each of ``batch.sample_seqs``; record the
        prompt logprobs of the sequences that ask (engine/sampling/prompt_logprobs.py)."""
        self._copy_blocks(batch.block_copies)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_pool, meta, self._lora_step(batch))  # [num_tokens, hidden]
        record_prompt_logprobs(self.model.compute_logits, hidden, batch, self._row_starts(batch, meta))
        if batch.has_drafts:
            return sample_with_drafts(self.model.compute_logits, hidden, batch, self.sampler)
        logits = self.model.compute_logits(self._sampled_hidden(hidden, batch))  # [num_samples, vocab]
        return self.sampler(logits, batch.sample_seqs)

    @torch.inference_mode()
    def execute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch's tokens and return the logits [num_samples, vocab] the sample seqs would
        sample from, unsampled: a draft model (engine/spec/draft.py) draws its drafts from them itself."""
        assert not batch.has_drafts, "a draft model's batch carries no drafts"
        self._copy_blocks(batch.block_copies)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_pool, meta, None)  # [num_tokens, hidden]
        return self.model.compute_logits(self._sampled_hidden(hidden, batch))

    def _row_starts(self, batch: ScheduledBatch, meta: AttentionMetadata) -> torch.Tensor:
        """Where each of the batch's sequences starts in the step's tokens: ``meta.query_start_loc``
        unless verify rows were split into decode rows (then no prompt chunk is in the step)."""
        if meta.query_start_loc.shape[0] == len(batch.seqs) + 1:
            return meta.query_start_loc
        return torch.tensor([0, *itertools.accumulate(batch.num_new_tokens)], dtype=torch.int32)

    def _sampled_hidden(self, hidden: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """The rows of ``hidden`` the sample seqs take their logits from: each one's sequence's last new
        token. A decode step (one token per sequence, each sampled once) takes every row in order: no
        gather."""
        if len(batch.sample_rows) == hidden.shape[0] and batch.sample_rows == list(range(hidden.shape[0])):
            return hidden
        last_rows = list(itertools.accumulate(batch.num_new_tokens))  # 1 past each seq's last new token
        rows = [last_rows[r] - 1 for r in batch.sample_rows]
        return hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]

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
        # [layers, 2, num_blocks, block_size, kv_heads, row bytes]: moved as bytes, since torch has no
        # index_copy_ for float8 (the fp8 pool), and bytes are what a copy moves whatever the dtype
        pool = self.kv_pool.tensor.view(torch.uint8)
        pool.index_copy_(2, dst, pool.index_select(2, src))

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs, built as Python lists and made tensors once each: a decode step of 16-32
        sequences took ~40 small torch ops with tensor index arithmetic (cumsum, repeat_interleave,
        gathers), ~2.5% of the step; lists of a few dozen ints cost less than one such op."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # block_id * block_size + offset of each new token
        context_lens: list[int] = []
        query_start_loc = [0]
        row_tables: list[list[int]] = []  # per attention row: its sequence's block table
        # Verify rows as decode rows (the module docstring): only with no prompt chunk in the step.
        split = batch.has_drafts and all(n == 1 or batch.drafts_of(i) for i, n in enumerate(batch.num_new_tokens))
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, table = seq.num_computed_tokens, seq.block_table
            end = start + n
            input_ids += seq.token_ids[start:end]  # a speculating seq's one known token, then its drafts
            input_ids += batch.drafts_of(i)
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if split:
                context_lens += range(start + 1, end + 1)
                query_start_loc += range(query_start_loc[-1] + 1, query_start_loc[-1] + n + 1)
                row_tables += [table] * n
            else:
                context_lens.append(end)
                query_start_loc.append(query_start_loc[-1] + n)
                row_tables.append(table)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [table + [0] * (max_blocks - len(table)) for table in row_tables]

        device = self.device
        block_tables = torch.tensor(tables, dtype=torch.int32, device=device)  # [batch, max_blocks]
        context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)
        query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=block_tables,
            context_lens=context_lens_t,
            query_start_loc=query_start_loc_t,
            plan=None
            if device.type == "cuda"
            else kernels.plan_attention(
                block_tables,
                context_lens_t,
                query_start_loc_t,
                self.kv_pool.layer(0)[0],
                self.native_decode,
                self.native_prefill,
            ),
        )
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)
        return input_ids_t, torch.tensor(positions, dtype=torch.long, device=device), meta
