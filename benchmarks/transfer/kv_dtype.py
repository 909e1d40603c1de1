"""One prompt's KV over each transport with ``--kv-cache-dtype`` auto (float32 on CPU) and int8, side by
side: the bytes of its blocks and the time to move them, both dtypes alternated in one run.

    python -m benchmarks.transfer.kv_transfer --kv-cache-dtype int8 [--prompt-tokens 1024]

Layout: the ``small`` model's (8 layers, 2 KV heads, head dim 64, block size 16). Last line::

    int8_bytes_vs_auto=<ratio> int8_zmq_time_vs_auto=<ratio> int8_shm_time_vs_auto=<ratio>
"""

from __future__ import annotations

import torch
import zmq
from prometheus_client import CollectorRegistry

from benchmarks.transfer.transfer_steps import handshake, one_transfer
from engine.kv.pool import KVLayout, KVPool
from kvtransfer.channel import InprocServer, ZmqClient, ZmqServer
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.shm_pool import create_shared

DTYPES = {"auto": torch.float32, "int8": torch.int8}
TRANSPORTS = ("loopback", "shm", "zmq")


def layout_for(dtype: torch.dtype, num_blocks: int) -> KVLayout:
    return KVLayout(num_layers=8, num_blocks=num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=dtype)


def random_pool(layout: KVLayout) -> torch.Tensor:
    if layout.dtype == torch.int8:
        return torch.randint(-128, 128, layout.shape, dtype=torch.int8)
    return torch.randn(layout.shape, dtype=layout.dtype)


class Pair:
    """A sender and a receiver over one transport, handshaken, for repeated transfers of n blocks."""

    def __init__(self, transport: str, layout: KVLayout):
        self.shared = create_shared(layout.shape, layout.dtype) if transport == "shm" else None
        self.dst = KVPool(layout, tensor=self.shared.tensor if self.shared else None)
        self.ctx = zmq.Context()
        self.server = (
            InprocServer()
            if transport == "loopback"
            else ZmqServer(self.ctx, "127.0.0.1", max_msg_size=layout.num_blocks * layout.bytes_per_block + (1 << 20))
        )
        self.rx = KVReceiver(
            self.dst,
            "small",
            self.server,
            lambda ids: None,
            TransferMetrics(CollectorRegistry()),
            credits=layout.num_blocks,
            shm_pool_name=self.shared.name if self.shared else None,
        )
        self.channel = self.server.connect() if transport == "loopback" else ZmqClient(self.ctx, self.server.endpoint)
        self.tx = KVSender(KVPool(layout, tensor=random_pool(layout)), "small", self.channel)
        handshake(self.rx, self.tx, transport)
        self.count = 0

    def transfer(self, n: int) -> float:
        self.count += 1
        seconds = one_transfer(self.rx, self.tx, f"p{self.count}", n)
        assert torch.equal(self.dst.tensor[:, :, :n], self.tx.pool.tensor[:, :, :n])  # the bytes really moved
        return seconds

    def close(self) -> None:
        self.rx.close()
        self.channel.close()
        self.ctx.destroy(linger=0)
        if self.shared:
            self.shared.unlink()


def compare(prompt_tokens: int, repeats: int) -> None:
    blocks = -(-prompt_tokens // 16)
    pairs = {(t, d): Pair(t, layout_for(DTYPES[d], blocks)) for t in TRANSPORTS for d in DTYPES}
    best: dict[tuple[str, str], float] = {}
    try:
        for _ in range(repeats):  # alternated: auto and int8 see the same machine moments
            for key, pair in pairs.items():
                best[key] = min(best.get(key, float("inf")), pair.transfer(blocks))
    finally:
        for pair in pairs.values():
            pair.close()
    nbytes = {d: blocks * layout_for(DTYPES[d], 1).bytes_per_block for d in DTYPES}
    print(f"{prompt_tokens}-token prompt, {blocks} blocks of 16 tokens (8 layers, 2 KV heads, head dim 64)")
    print(f"{'dtype':>6} {'bytes':>10} " + " ".join(f"{t + ' ms':>12}" for t in TRANSPORTS))
    for d in DTYPES:
        print(f"{d:>6} {nbytes[d]:>10} " + " ".join(f"{best[(t, d)] * 1e3:>12.3f}" for t in TRANSPORTS))
    print(
        f"int8_bytes_vs_auto={nbytes['int8'] / nbytes['auto']:.3f} "
        + " ".join(f"int8_{t}_time_vs_auto={best[(t, 'int8')] / best[(t, 'auto')]:.3f}" for t in ("zmq", "shm"))
    )
