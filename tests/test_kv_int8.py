"""The int8 KV cache (``--kv-cache-dtype int8``): the packed row format, the store, attention over it,
the engine with it, and transfers of it. Each is checked against an independent reference: a
float64 attention over the dequantized values, a quantizer written out element by element, the
engine with ``auto`` KV, and the source pool's bytes."""

from __future__ import annotations

import math

import pytest
import torch

from configs.schema import ConfigError
from engine.kv.cache_dtype import kv_storage_dtype
from engine.kv.pool import KVLayout, KVPool
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from kernels import paged_attention, store_kv
from kernels.triton import kv_int8
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.test_engine_generate import PROMPT_LENGTHS, random_prompts


def quantize_by_hand(row: list[float]) -> tuple[list[int], float]:
    """The format's definition, one element at a time in float32 (numpy-free: torch scalars)."""
    x = torch.tensor(row, dtype=torch.float32)
    amax = torch.tensor(max(abs(float(v)) for v in x), dtype=torch.float32)
    scale = (amax / torch.tensor(127.0, dtype=torch.float32)).half().float()  # stored as float16
    if float(scale) == 0.0:
        return [0] * len(row), 0.0
    inv = torch.tensor(1.0, dtype=torch.float32) / scale  # the values are rounded against the stored scale
    values = [int(max(-127.0, min(127.0, float(torch.round(v * inv))))) for v in x]
    return values, float(scale)


def test_store_writes_the_defined_bytes_and_dequantizes_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    kv_heads, head_dim, block_size = 2, 64, 4  # four scale groups of 16 per row
    key = torch.randn(5, kv_heads, head_dim, generator=g) * torch.tensor([0.01, 30.0])[None, :, None]
    value = torch.randn(5, kv_heads, head_dim, generator=g)
    value[2, 1, 32:] = 0.0  # all-zero groups keep scale 0
    value[3, 0, :16] *= 1e-7  # a scale below float16's range: zeros, never a division by zero
    row = kv_int8.row_dim(head_dim)
    assert row == 72
    k_cache = torch.zeros(4, block_size, kv_heads, row, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([13, 0, 6, 7, 2])
    store_kv(key, value, k_cache, v_cache, slots)
    for cache, src in ((k_cache, key), (v_cache, value)):
        flat = cache.view(-1, kv_heads, row)
        for t, slot in enumerate(slots.tolist()):
            for h in range(kv_heads):
                for j in range(4):
                    part = src[t, h, 16 * j : 16 * j + 16]
                    values, scale = quantize_by_hand(part.tolist())
                    assert flat[slot, h, 16 * j : 16 * j + 16].tolist() == values
                    assert float(kv_int8.scales(flat[slot, h])[j]) == scale
                    got = kv_int8.dequantize_rows(flat[slot, h])[16 * j : 16 * j + 16]
                    # half a step, plus what the clamp at 127 cuts when float16 rounded the scale down
                    clipped = max(0.0, float(part.abs().max()) - 127.5 * scale)
                    assert (got - part).abs().max() <= scale / 2 * (1 + 1e-6) + clipped
        untouched = [s for s in range(16) if s not in slots.tolist()]
        assert not flat[untouched].any()


def test_head_dim_must_keep_the_scale_aligned():
    with pytest.raises(ValueError, match="head_dim divisible by 2"):
        kv_int8.row_dim(9)
    with pytest.raises(ValueError, match="and by 16 past 16"):
        kv_int8.row_dim(24)


def test_pool_capacity_and_block_bytes_against_float32():
    f32 = KVLayout(30, 1, 16, 3, 64, torch.float32)  # SmolLM2-135M's KV shape
    i8 = KVLayout(30, 1, 16, 3, 64, torch.int8)
    assert i8.bytes_per_block / f32.bytes_per_block == 72 / 256  # 0.28 <= 0.3
    budget = 64 << 20
    assert (budget // i8.bytes_per_block) / (budget // f32.bytes_per_block) >= 3.5
    assert KVPool(KVLayout(2, 3, 4, 2, 8, torch.int8)).tensor.shape == (2, 2, 3, 4, 2, 10)  # 8 values + a float16


def test_fp8_on_cpu_is_a_start_up_error_naming_the_flag():
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8 .* needs a GPU"):
        kv_storage_dtype("fp8", torch.float32, "cpu")
    assert kv_storage_dtype("int8", torch.float32, "cpu") is torch.int8
    assert kv_storage_dtype("int8", torch.bfloat16, "cuda") is torch.int8  # the Triton kernels read it too
    assert kv_storage_dtype("auto", torch.bfloat16, "cuda") is torch.bfloat16


def attention_float64(q, k_rows, v_rows, tables, context_lens, q_start, scale):
    """Causal attention in float64 over the dequantized pool, request by request, GQA by repetition."""
    k = kv_int8.dequantize_rows(k_rows).double().flatten(0, 1)  # [slots, kvh, d]
    v = kv_int8.dequantize_rows(v_rows).double().flatten(0, 1)
    block_size, group = k_rows.shape[1], q.shape[1] // k_rows.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, ctx in enumerate(context_lens.tolist()):
        slots = torch.tensor([tables[i, t // block_size] * block_size + t % block_size for t in range(ctx)])
        kk = k[slots].repeat_interleave(group, 1).transpose(0, 1)  # [h, ctx, d]
        vv = v[slots].repeat_interleave(group, 1).transpose(0, 1)
        lo, hi = int(q_start[i]), int(q_start[i + 1])
        qq = q[lo:hi].double().transpose(0, 1)  # [h, n, d]
        scores = qq @ kk.transpose(1, 2) * scale
        pos = torch.arange(ctx - (hi - lo), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, -math.inf)
        out[lo:hi] = (torch.softmax(scores, -1) @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 17], [9, 3]])  # decode, mixed, prefill chunks
def test_paged_attention_reads_int8_as_the_float64_reference(q_lens):
    g = torch.Generator().manual_seed(11)
    num_heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 40
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g))
    v_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g))
    context_lens = torch.tensor([n + 7 * i + 3 for i, n in enumerate(q_lens)])
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(q_lens) * 12].view(len(q_lens), 12).int()  # 48 slots each
    q_start = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    got = paged_attention(q, k_cache, v_cache, tables, context_lens.int(), q_start, head_dim**-0.5)
    want = attention_float64(q, k_cache, v_cache, tables, context_lens, q_start, head_dim**-0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_engine_int8_greedy_agrees_with_auto_and_leaks_nothing():
    path = str(tiny_model_dir("llama"))
    prompts = random_prompts(PROMPT_LENGTHS, 768, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(path, block_size=16, prefill_chunk_size=64, kv_cache_memory_mb=8, kv_cache_dtype=kv)
        runs[kv] = [o.outputs[0] for o in llm.generate(prompts, greedy)]
        assert_no_leak(llm.engine.block_manager)
    worst = 0.0
    for plain, quant in zip(runs["auto"], runs["int8"]):
        assert quant.token_ids == plain.token_ids
        worst = max(worst, *(abs(a.logprob - b.logprob) for a, b in zip(plain.logprobs, quant.logprobs)))
    # Measured 0.0014 on this model (2026-11-28, EPYC); 0.01 is the bound: a wrong read (a scale
    # misplaced, a row from another token) moves logprobs by far more than that on a random model.
    assert worst < 0.01, worst


INT8_LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype=torch.int8)


@pytest.mark.parametrize("transport", ["loopback", "shm", "zmq"])
def test_int8_blocks_travel_as_they_are_with_their_scales(transport):
    from tests.test_kvtransfer_transports import Node, pump

    node = Node(transport, layout=INT8_LAYOUT)
    try:
        tx = node.sender(layout=INT8_LAYOUT)
        src_ids, dst_ids = [0, 5, 2, 9], [14, 3, 8, 1]
        node.reserve("r1", 1, dst_ids)
        tx.send("r1", 1, src_ids, dst_ids)
        tx.commit("r1", 1, first_token=3, first_logprob=-0.5, top_token_ids=[3], top_logprobs=[-0.5])
        [done], _ = pump(node, tx, until=lambda rx, tx: rx and tx)
        assert done.ok and node.rx.pool.tensor.dtype == torch.int8
        assert torch.equal(node.rx.pool.tensor[:, :, dst_ids], tx.pool.tensor[:, :, src_ids])
        # The bytes on the wire: 10 int8 per row (8 values + a float16 scale) against float32's 32.
        sent = node.sample("pdserve:kv_transfer_bytes_sum", transport=transport)
        assert sent == 4 * INT8_LAYOUT.bytes_per_block == 4 * 2 * 2 * 4 * 2 * 10
        assert node.rx.adopt("r1") == tuple(dst_ids)
        assert node.rx.table.held_blocks() == {} and tx.pinned_blocks() == []
    finally:
        node.close()


@pytest.mark.parametrize(
    "theirs,ours",
    [
        (torch.float32, torch.int8),
        (torch.int8, torch.float32),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.int8, torch.float8_e4m3fn),
    ],
)
def test_peers_with_different_kv_dtypes_refuse_each_other_naming_the_field(theirs, ours):
    """The handshake's dtype check comes before a transport is chosen: cuda_ipc peers are refused alike."""
    from kvtransfer.sender import HandshakeError
    from tests.test_kvtransfer_transports import Node

    node = Node("zmq", layout=KVLayout(2, 16, 4, 2, 8, ours))
    try:
        name = {
            torch.float32: "float32",
            torch.int8: "int8",
            torch.bfloat16: "bfloat16",
            torch.float8_e4m3fn: "float8_e4m3fn",
        }
        with pytest.raises(HandshakeError, match=f"dtype is '{name[theirs]}' there but '{name[ours]}' here") as info:
            node.sender(layout=KVLayout(2, 16, 4, 2, 8, theirs))
        assert info.value.field == "dtype"
        assert node.sample("pdserve:kv_handshakes_total", result="refused") == 1
        assert node.rx.table.held_blocks() == {}
    finally:
        node.close()


@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 1, 128), (2, 2, 32)])
def test_c_decode_reads_int8_as_the_float64_reference(num_heads, kv_heads, head_dim):
    from kernels.cpu import native
    from kernels.cpu.kv_int8 import Int8KV

    library = native.load()
    assert library is not None, "the C kernels must build on the test machine"
    g = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, batch = 16, 30, 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g) * 3)
    v_cache = kv_int8.quantize_rows(torch.randn(shape, generator=g))
    context_lens = torch.tensor([1, 77, 160])
    tables = torch.randperm(num_blocks, generator=g)[: batch * 10].view(batch, 10)
    q = torch.randn(batch, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    got = Int8KV(library).decode(q, k_cache, v_cache, tables.contiguous(), context_lens, 160, scale)
    q_start = torch.arange(batch + 1)
    want = attention_float64(q, k_cache, v_cache, tables, context_lens, q_start, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_prefill_worker_ships_int8_kv_equal_to_the_single_int8_engine(transport):
    """P/D: the prefill worker's int8 blocks (scales inside) land in the decode pool byte for byte as a
    single int8 engine stores them, with its first token; the wire carries int8 bytes, nothing leaks."""
    from tests.test_prefill_node import Cluster, prompt, reference

    c = Cluster(transport=transport, kv_cache_dtype="int8")
    try:
        tokens = prompt(19, seed=1)  # 3 chunks, 5 blocks of 4
        ref_kv, ref_token = reference(tokens, kv_cache_dtype="int8")
        assert ref_kv.dtype == torch.int8
        c.start()
        job = c.decode.job("r1", tokens)
        c.decode.send(job)
        done = c.decode.wait_event("r1")
        assert done.ok and done.commit.first_token == ref_token
        assert torch.equal(c.decode.kv_tokens(job.dst_block_ids, len(tokens)), ref_kv)
        c.decode.adopt("r1")
        c.stop()
        layout = c.engine.runner.kv_pool.layout
        sent = c.decode.registry.get_sample_value("pdserve:kv_transfer_bytes_sum", {"transport": transport})
        assert sent == 5 * layout.bytes_per_block == 5 * layout.num_layers * 2 * 4 * layout.kv_heads * (16 + 2)
        c.assert_idle_no_leak()
    finally:
        c.close()
