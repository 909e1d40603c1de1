"""Our paged-KV model gives transformers' (eager attention) fp32 logits, whatever the batching.

Every case compares against ``transformers`` run on each whole sequence at once: one-shot prefill,
chunked prefill over a permuted (non-contiguous) block table, a varlen batch of mixed lengths, and
decode steps after a prefill. The batch and decode cases also run with every matmul in the packed
CPU form and in the C linear (engine/model/cpu_linear.py, kernels/cpu/linear.c), which load-time timing picks
at some row counts for real checkpoints; the decode case with decode attention both in torch and in the
C kernel (kernels/cpu/decode.c). The prefill, batch and decode cases run with the layer's norms and RoPE
both in torch and in C (kernels/cpu/layer_ops.c).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

import kernels
from engine.kv.pool import KVLayout, KVPool
from engine.model.loader import load_model
from engine.step.attention_metadata import AttentionMetadata
from kernels.cpu import native as cpu_native
from tests.model_factory import tiny_model_dir
from tests.test_cpu_linear import use_forms_everywhere

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4


@functools.cache
def _models(family: str, form: str = "plain", layer_ops: str = "torch"):
    path = tiny_model_dir(family)
    ours, config = load_model(path)
    if form != "plain":
        use_forms_everywhere(ours, form)
    if layer_ops == "c":
        native = cpu_native.load()
        assert native is not None, "the C kernels did not build here"
        ours.use_native_layer_ops(native)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return ours, config, reference.eval()


@torch.no_grad()
def _reference_logits(reference, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    return reference(torch.tensor([token_ids])).logits[0].float()


class PagedHarness:
    """Plays the block manager and the runner: hands out blocks in a shuffled order, builds the
    step's slot mapping and metadata by hand, runs the model, splits logits per request."""

    def __init__(
        self,
        model,
        config,
        block_size: int,
        num_blocks: int = 96,
        seed: int = 0,
        native_decode: cpu_native.NativeLibrary | None = None,
        kv_dtype: torch.dtype = torch.float32,  # torch.int8: --kv-cache-dtype int8's pool
    ):
        self.model = model
        self.native_decode = native_decode  # None: decode rows take the torch path
        self.pool = KVPool(
            KVLayout(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, kv_dtype)
        )
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()  # popped from the end
        self.tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (request id, its next new tokens). Returns each request's logits ``[n_i, vocab]``."""
        input_ids, positions, slots, lens = [], [], [], []
        for rid, tokens in chunks:
            start = self.num_computed.get(rid, 0)
            table = self.tables.setdefault(rid, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            lens.append(len(tokens))
            self.num_computed[rid] = end
        max_blocks = max(len(self.tables[rid]) for rid, _ in chunks)
        tables = [self.tables[rid] + [0] * (max_blocks - len(self.tables[rid])) for rid, _ in chunks]
        block_tables = torch.tensor(tables, dtype=torch.int32)
        context_lens = torch.tensor([self.num_computed[rid] for rid, _ in chunks], dtype=torch.int32)
        query_start_loc = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        plan = kernels.plan_attention(
            block_tables, context_lens, query_start_loc, self.pool.tensor[0, 0], self.native_decode
        )
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta = AttentionMetadata(slot_mapping, block_tables, context_lens, query_start_loc, plan)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.pool, meta)  # [T, hidden]
        assert hidden.shape == (len(input_ids), self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        assert logits.dtype == torch.float32
        return list(logits.split(lens))


def _prompt(config, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_prompt_in_one_step(family):
    model, config, reference = _models(family)
    prompt = _prompt(config, 100, seed=1)
    (ours,) = PagedHarness(model, config, block_size=16).step([(0, prompt)])
    torch.testing.assert_close(ours, _reference_logits(reference, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer_ops", ["torch", "c"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, 64])
@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_prefill_over_permuted_blocks(family, chunk, block_size, layer_ops):
    model, config, reference = _models(family, layer_ops=layer_ops)
    prompt = _prompt(config, 150, seed=2)
    harness = PagedHarness(model, config, block_size=block_size, seed=chunk)
    pieces = [harness.step([(0, prompt[i : i + chunk])])[0] for i in range(0, len(prompt), chunk)]
    table = harness.tables[0]
    assert table != sorted(table), "block table should be non-contiguous"
    torch.testing.assert_close(torch.cat(pieces), _reference_logits(reference, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer_ops", ["torch", "c"])
@pytest.mark.parametrize("form", ["plain", "packed", "c"])
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_batch_of_mixed_lengths(family, form, layer_ops):
    model, config, reference = _models(family, form, layer_ops)
    lengths = [1, 37, 300, 5, 64, 2]
    prompts = [_prompt(config, n, seed=10 + i) for i, n in enumerate(lengths)]
    harness = PagedHarness(model, config, block_size=16, num_blocks=64)
    outputs = harness.step(list(enumerate(prompts)))
    for prompt, ours in zip(prompts, outputs):
        torch.testing.assert_close(ours, _reference_logits(reference, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer_ops", ["torch", "c"])
@pytest.mark.parametrize("attention", ["torch", "c"])
@pytest.mark.parametrize("form", ["plain", "packed", "c"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_after_prefill(family, form, attention, layer_ops):
    model, config, reference = _models(family, form, layer_ops)
    prompts = [_prompt(config, 21, seed=20), _prompt(config, 9, seed=21)]
    continuations = [_prompt(config, 12, seed=22), _prompt(config, 12, seed=23)]
    native = cpu_native.load() if attention == "c" else None
    assert attention == "torch" or native is not None, "the C kernels did not build here"
    harness = PagedHarness(model, config, block_size=8, native_decode=native)
    prefill = harness.step([(0, prompts[0]), (1, prompts[1])])
    decoded = [[out[-1]] for out in prefill]  # logits predicting each request's next token
    for step in range(len(continuations[0])):
        outputs = harness.step([(rid, [continuations[rid][step]]) for rid in (0, 1)])
        for rid, out in enumerate(outputs):
            assert out.shape[0] == 1
            decoded[rid].append(out[0])
    for rid in (0, 1):
        full = prompts[rid] + continuations[rid]
        expected = _reference_logits(reference, full)[len(prompts[rid]) - 1 :]  # [1 + 12, vocab]
        torch.testing.assert_close(torch.stack(decoded[rid]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer_ops", ["torch", "c"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family, layer_ops):
    model, config, reference = _models(family, layer_ops=layer_ops)
    prompt = _prompt(config, 13, seed=30)
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    harness = PagedHarness(model, config, block_size=4)
    next_token = int(harness.step([(0, prompt)])[0][-1].argmax())
    generated = [next_token]
    while len(generated) < 10:
        next_token = int(harness.step([(0, [next_token])])[0][-1].argmax())
        generated.append(next_token)
    assert generated == expected
