"""cuda_ipc transport: the receiver's CUDA pool is exported once; a sender process copies into it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SENDER = textwrap.dedent("""
    import sys, torch, zmq
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqClient
    from kvtransfer.sender import KVSender
    layout = KVLayout(2, 32, 16, 2, 64, torch.bfloat16)
    data = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(layout.dtype).cuda()
    tx = KVSender(KVPool(layout, tensor=data), "tiny", ZmqClient(zmq.Context(), sys.argv[1]))
    assert tx.handshake(timeout_s=60).transport == "cuda_ipc"
    tx.send("r", 1, [0, 3, 5], [30, 2, 17])
    tx.commit("r", 1, first_token=11)
    while not tx.poll():
        pass
    print("done", flush=True)
""")


def test_cuda_ipc_bit_exact_between_processes():
    from engine.kv.pool import KVLayout, KVPool
    from kvtransfer.channel import ZmqServer
    from kvtransfer.metrics import TransferMetrics
    from kvtransfer.receiver import KVReceiver

    layout = KVLayout(2, 32, 16, 2, 64, torch.bfloat16)
    ctx = zmq.Context()
    server = ZmqServer(ctx, "127.0.0.1", max_msg_size=1 << 24)
    registry = CollectorRegistry()
    rx = KVReceiver(KVPool(layout, device="cuda"), "tiny", server, lambda ids: None, TransferMetrics(registry))
    rx.reserve("r", 1, [30, 2, 17])
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, server.endpoint], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    try:
        events, give_up = [], time.monotonic() + 120
        while not events:
            events = rx.poll()
            assert time.monotonic() < give_up and proc.poll() in (None, 0)
        assert events[0].ok and events[0].commit.first_token == 11
        expected = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(layout.dtype)
        assert torch.equal(rx.pool.tensor[:, :, [30, 2, 17]].cpu(), expected[:, :, [0, 3, 5]])
        assert registry.get_sample_value("pdserve:kv_transfer_bytes_count", {"transport": "cuda_ipc"}) == 1
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        rx.close()
        ctx.destroy(linger=0)
