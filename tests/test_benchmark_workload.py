"""The benchmark's workload generator, its static-batching baseline and its FLOP count."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common.workload import WorkloadSpec, make_workload
from benchmarks.engine import matmul_floor, roofline
from benchmarks.peers import hf_baseline


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def greedy_by_full_recompute(model, prompt: tuple[int, ...], n: int) -> list[int]:
    """Independent oracle: argmax of a full no-cache forward pass, one token at a time."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits  # [1, len(ids), vocab]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_workload_is_deterministic_and_in_range():
    spec = WorkloadSpec(vocab_size=1000, num_requests=64, seed=0)
    a, b = make_workload(spec), make_workload(spec)
    assert a == b
    assert make_workload(WorkloadSpec(vocab_size=1000, num_requests=64, seed=1)) != a
    assert [r.index for r in a] == list(range(64))
    prompt_lens = [r.prompt_len for r in a]
    output_lens = [r.output_len for r in a]
    assert all(64 <= n <= 512 for n in prompt_lens) and all(16 <= n <= 256 for n in output_lens)
    assert len(set(prompt_lens)) > 30 and len(set(output_lens)) > 30  # actually spread, not constant
    ids = [t for r in a for t in r.prompt_token_ids]
    assert min(ids) >= 0 and max(ids) < 1000 and len(set(ids)) > 900
    # A prefix of a longer workload is the shorter workload: serving benchmarks can cut it.
    assert make_workload(WorkloadSpec(vocab_size=1000, num_requests=8, seed=0)) == a[:8]


def test_static_batching_counts_only_requested_tokens():
    model = tiny_llama()
    spec = WorkloadSpec(vocab_size=97, num_requests=5, prompt_len_range=(3, 9), output_len_range=(1, 6), seed=3)
    requests = make_workload(spec)
    assert len({r.output_len for r in requests}) > 1  # batches really overshoot some rows

    static = hf_baseline.run_static_batching(model, requests, batch_size=2)  # batches {0,1} {2,3} {4}
    one = hf_baseline.run_one_at_a_time(model, requests)

    assert static.output_tokens == sum(r.output_len for r in requests)
    assert one.output_tokens == sum(r.output_len for r in requests)
    for r in requests:
        expected = greedy_by_full_recompute(model, r.prompt_token_ids, r.output_len)
        assert static.outputs[r.index] == expected, r.index
        assert one.outputs[r.index] == expected, r.index


def test_linear_flops_match_torch_flop_counter():
    model = tiny_llama()
    model.set_attn_implementation("eager")  # attention as plain matmuls, which the counter sees
    shape = roofline.DecoderShape.from_hf_config(model.config)
    n = 7
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(torch.arange(n)[None], logits_to_keep=1)  # prefill of 7 tokens, logits of the last one
    # Eager attention computes the full (masked afterwards) n x n product: QK^T and PV, 2 * n * n * d each.
    full_attention = shape.num_layers * 4 * n * n * shape.num_heads * shape.head_dim
    assert counter.get_total_flops() == roofline.linear_flops(shape, n, 1) + full_attention


def test_causal_attention_flops_and_request_accounting():
    shape = roofline.DecoderShape(
        num_layers=2, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10
    )
    # Positions 0..3 read 1+2+3+4 = 10 keys; QK^T and PV: 2 * 2 * heads * head_dim per key, per layer.
    assert roofline.causal_attention_flops(shape, 4) == 10 * 4 * 2 * 4 * 2
    # P=3 prompt, L=2 output: tokens 0..3 processed (the last sampled one never is), 2 sampled.
    expected = roofline.linear_flops(shape, 4, 2) + roofline.causal_attention_flops(shape, 4)
    assert roofline.request_flops(shape, 3, 2) == expected
    assert roofline.linear_flops(shape, 1, 0) == 2 * 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 8)


def test_decode_rows_count_the_requests_still_decoding_at_each_step():
    # Outputs 1, 3 and 2: each samples its first token in prefill; steps 1 and 2 decode {3, 2} then {3}.
    assert matmul_floor.decode_rows([1, 3, 2]) == [2, 1]
    assert matmul_floor.decode_rows([1, 1]) == []


def test_matmul_floor_replaces_the_decode_projections_ideal_time_by_the_measured_one():
    shape = roofline.DecoderShape(
        num_layers=2, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10
    )
    lengths = [(5, 3), (4, 2)]  # decode steps of 2 rows, then 1 row
    required = roofline.workload_flops(shape, lengths)
    floor = matmul_floor.matmul_floor(shape, lengths, required, flops_per_s=1e9, repeats=1)
    decode_flops = roofline.linear_flops(shape, 2, 2) + roofline.linear_flops(shape, 1, 1)
    assert floor.num_decode_steps == 2
    assert floor.ideal_s == required / 1e9 and floor.decode_ideal_s == decode_flops / 1e9
    assert floor.decode_measured_s > 0
    assert floor.floor_s == floor.ideal_s - floor.decode_ideal_s + floor.decode_measured_s
    assert floor.roofline_at_floor == floor.ideal_s / floor.floor_s
