"""The pieces the honest ratios are built from, checked exactly: the bytes a roofline prices, the shapes
and the max-selection of the fastest matmul, and the tuned zmq baseline moving what pdserve moves.
No timing is asserted."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
import zmq
from prometheus_client import CollectorRegistry

from benchmarks.engine import fastest_matmul, roofline
from benchmarks.engine.fastest_matmul import KernelTiming, MatmulShape
from benchmarks.transfer import ceilings as transfer_ceilings
from engine.kv.pool import KVLayout, KVPool
from kvtransfer.channel import ZmqClient, ZmqServer
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from tests.test_benchmark_workload import tiny_llama

SHAPE = roofline.DecoderShape(
    num_layers=2, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10
)


def test_weight_bytes_are_every_linear_weight_of_the_hf_model():
    model = tiny_llama()  # lm_head its own Linear (untied)
    linear_numel = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.weight_bytes(roofline.DecoderShape.from_hf_config(model.config)) == 4 * linear_numel


def test_decode_kv_bytes_count_each_decode_tokens_context():
    per_position = 2 * 1 * 4 * 2 * 4  # K and V, 1 KV head of dim 4, 2 layers, fp32
    # P=3, L=3: decode steps at positions 3 and 4 read 4 and 5 positions. L=1: no decode step.
    assert roofline.decode_kv_bytes(SHAPE, [(3, 3)]) == 9 * per_position
    assert roofline.decode_kv_bytes(SHAPE, [(5, 1)]) == 0
    assert roofline.decode_kv_bytes(SHAPE, [(3, 3), (1, 2)]) == (9 + 2) * per_position
    assert roofline.min_forward_passes([(3, 3), (1, 5), (9, 1)]) == 5
    expected = 5 * roofline.weight_bytes(SHAPE) + roofline.decode_kv_bytes(SHAPE, [(3, 3), (1, 5)])
    assert roofline.workload_bytes(SHAPE, [(3, 3), (1, 5)]) == expected


def test_roofline_takes_the_larger_of_flop_and_byte_time():
    flop_bound = roofline.Roofline(flops=100.0, flops_per_s=10.0, num_bytes=30.0, bytes_per_s=10.0)
    assert (flop_bound.flop_s, flop_bound.bytes_s, flop_bound.ideal_s, flop_bound.bound) == (10.0, 3.0, 10.0, "FLOP")
    assert flop_bound.fraction(20.0) == 0.5
    memory_bound = roofline.Roofline(flops=10.0, flops_per_s=10.0, num_bytes=40.0, bytes_per_s=10.0)
    assert (memory_bound.ideal_s, memory_bound.bound) == (4.0, "memory")


def test_benchmark_shapes_carry_the_flops_the_roofline_counts():
    shapes = fastest_matmul.benchmark_shapes(SHAPE, decode_rows=(1, 3), prefill_rows=(7,))
    for rows in (1, 3, 7):
        projections = [s for s in shapes if s.rows == rows and s.name != "lm_head"]
        assert [s.name for s in projections] == ["qkv", "o", "gate_up", "down"]
        assert SHAPE.num_layers * sum(s.flops for s in projections) == roofline.linear_flops(SHAPE, rows, 0)
    heads = [s for s in shapes if s.name == "lm_head"]
    assert [s.rows for s in heads] == [1, 3]  # sampled rows: never a prefill step's row count
    assert heads[1].flops == roofline.linear_flops(SHAPE, 0, 3)


def test_thread_counts_are_powers_of_two_and_the_cores():
    assert fastest_matmul.thread_counts(1) == [1]
    assert fastest_matmul.thread_counts(2) == [1, 2]
    assert fastest_matmul.thread_counts(6) == [1, 2, 4, 6]


def test_fastest_keeps_each_shapes_quickest_kernel_and_peak_the_highest_rate():
    small, large = MatmulShape("o", 1, 8, 8), MatmulShape("o", 64, 8, 8)
    timings = [
        KernelTiming(small, "plain", 2, 3.0),
        KernelTiming(small, "c", 1, 1.0),
        KernelTiming(small, "packed", 2, 1.0),  # as fast as c: the first of equals stays
        KernelTiming(large, "plain", 2, 2.0),
        KernelTiming(large, "transposed", 1, 4.0),
    ]
    best = fastest_matmul.fastest(timings)
    assert (best[small].kernel, best[small].threads) == ("c", 1)
    assert best[large].kernel == "plain"
    # 2*64*8*8 / 2.0 s beats 2*1*8*8 / 1.0 s
    assert fastest_matmul.peak(best) is best[large]


def test_every_timed_kernel_computes_the_linear():
    from kernels.cpu import native as cpu_native

    weight = torch.randn(64, 32)  # [out, in]
    x = torch.randn(5, 32)
    forms = fastest_matmul._forms(weight, cpu_native.load())
    assert {"plain", "transposed"} <= set(forms) <= set(fastest_matmul.KERNELS)
    for kernel, run in forms.items():
        torch.testing.assert_close(run(x), F.linear(x, weight), msg=kernel)
    timings = fastest_matmul.time_kernels([MatmulShape("o", 3, 32, 64)], threads=[1], repeats=1)
    assert sorted(t.kernel for t in timings) == sorted(forms)


def _layout(num_blocks: int) -> KVLayout:
    return KVLayout(num_layers=2, num_blocks=num_blocks, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)


def test_raw_tuned_frames_carry_exactly_the_blocks_in_either_framing():
    src = torch.randn(_layout(10).shape)  # [L, 2, blocks, bs, kvh, d]
    for framing in transfer_ceilings.FRAMINGS:
        dst = torch.zeros_like(src)
        for start, count in transfer_ceilings.piece_spans(7, 3):
            frames = transfer_ceilings.piece_frames(src, start, count, framing)
            assert sum(f.nbytes for f in frames) == count * _layout(1).bytes_per_block
            transfer_ceilings.land_frames(dst, start, count, [memoryview(f) for f in frames], framing)
        assert torch.equal(dst[:, :, :7], src[:, :, :7]) and not dst[:, :, 7:].any(), framing
    assert transfer_ceilings.piece_spans(7, 3) == [(0, 3), (3, 3), (6, 1)]


class RecordingServer(ZmqServer):
    """pdserve's server channel, noting the size of every raw-bytes frame that arrives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.raw_frame_bytes: list[int] = []

    def recv(self):
        message = super().recv()
        if message is not None and len(message[1]) > 1:
            self.raw_frame_bytes.append(len(message[1][1]))
        return message


def test_raw_tuned_sends_pdserves_pieces_and_bytes():
    blocks, window = 10, 4
    layout = _layout(blocks)
    ctx = zmq.Context()
    server = RecordingServer(ctx, "127.0.0.1", max_msg_size=window * layout.bytes_per_block + (1 << 20))
    rx = KVReceiver(KVPool(layout), "m", server, lambda ids: None, TransferMetrics(CollectorRegistry()), credits=window)
    channel = ZmqClient(ctx, server.endpoint)
    tx = KVSender(KVPool(layout, tensor=torch.randn(layout.shape)), "m", channel, transports=("zmq",))
    stop = threading.Event()
    serving = threading.Thread(target=lambda: [rx.poll() for _ in iter(stop.is_set, True)])
    serving.start()
    try:
        tx.handshake()
    finally:
        stop.set()
        serving.join()
    ids = list(range(blocks))
    rx.reserve("r", 1, ids)
    tx.send("r", 1, ids, ids)
    tx.commit("r", 1)
    events = []
    while not events:
        tx.poll()
        events = rx.poll()
    assert events[0].ok
    channel.close()
    server.close()
    ctx.destroy(linger=0)

    pair = transfer_ceilings.RawZmqPair(window * layout.bytes_per_block + (1 << 20), curve=False)
    try:
        dst = torch.zeros(layout.shape)
        moved = pair.transfer(tx.pool.tensor, dst, blocks, window // 2, "gathered")
    finally:
        pair.close()
    assert torch.equal(dst, tx.pool.tensor)
    assert moved == sum(server.raw_frame_bytes) == blocks * layout.bytes_per_block
    frames = [
        transfer_ceilings.piece_frames(tx.pool.tensor, s, n, "gathered")[0].nbytes
        for s, n in transfer_ceilings.piece_spans(blocks, window // 2)
    ]
    assert frames == server.raw_frame_bytes  # the same pieces, in the same order
