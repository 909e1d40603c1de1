"""benchmarks.gpu.scale without a GPU: the roofline arithmetic at the Llama-3-8B shape, and the whole
benchmark dry-run at the tiny shape on the CPU, so the GPU run is one command known to start."""

from __future__ import annotations

import json

from benchmarks.gpu import scale
from benchmarks.gpu.roofline import Shape, roofline_tokens_per_s

LLAMA3_8B = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False)  # fmt: skip
PARAMS_8B = 8_030_261_248  # Meta-Llama-3-8B's published count
EMBEDDING = 128256 * 4096


def test_decode_bytes_and_roofline_at_the_8b_shape():
    assert LLAMA3_8B.layers * LLAMA3_8B.layer_weights + LLAMA3_8B.norm_weights + 2 * EMBEDDING == PARAMS_8B
    assert LLAMA3_8B.kv_bytes_per_token(2) == 131072  # 128 KiB a token in bf16: 4k tokens are 512 MiB
    weights_read = (PARAMS_8B - EMBEDDING) * 2  # the embedding is looked up, not streamed
    assert LLAMA3_8B.decode_step_bytes(1, 1024, 2) == weights_read + 1024 * 131072
    assert LLAMA3_8B.decode_step_bytes(64, 1024, 2) == weights_read + 64 * 1024 * 131072
    # At the H200's measured 4199 GB/s copy bandwidth (issue #48), batch 1: 0.7 of it is the issue's 190 tok/s.
    assert 190 < 0.7 * roofline_tokens_per_s(LLAMA3_8B, 1, 1024, 2, 4199.0) < 200


def test_prefill_flops_by_hand():
    s = Shape(layers=1, hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10, tied=True)
    assert s.layer_weights == 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8  # q,k,v + o + gate,up,down = 144
    # 3 tokens: linear 2*144*3, attention 2*2*2 heads*2 dims*(1+2+3 pairs), LM head once 2*10*4
    assert s.prefill_flops(3) == 2 * 144 * 3 + 2 * 2 * 2 * 2 * 6 + 2 * 10 * 4


def test_tiny_dry_run_on_cpu(tmp_path):
    out = tmp_path / "scale.json"
    assert scale.main(["--shape", "tiny", "--device", "cpu", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    plan = scale.PLANS["tiny"]
    assert figures["device"] == "cpu" and figures["dtype"] == "float32"
    assert figures["copy_gbps"] > 0 and figures["matmul_tflops"] > 0
    assert sorted(int(b) for b in figures["decode"]) == plan.batches
    for row in figures["decode"].values():
        assert row["tps"] > 0 and row["roofline_tps"] > 0 and row["of_roofline"] > 0 and row["vs_hf"] > 0
    assert figures["prefill"]["tokens"] == plan.prefill_tokens and figures["prefill"]["hf_seconds"] > 0
    shape = Shape(**figures["shape"])
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 64, 768)
    moved = figures["transfer"]
    assert moved["bytes"] == plan.transfer_tokens * shape.kv_bytes_per_token(4)
    assert moved["share_of_ttft"] > 0 and moved["of_copy"] > 0
