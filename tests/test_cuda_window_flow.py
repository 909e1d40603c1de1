"""The cuda_ipc window protocol end to end on CPU: the real sender, receiver, ownership checks, arena and
copies, with only the device parts stood in for (no GPU in CI): CPU buffers for cuMemAlloc, and an
"IPC mapping" that hands the importer the exporter's tensor, in one process. tests/gpu/test_gpu_cuda_ipc.py
runs the same path between two processes on a GPU."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.kv.pool import KVLayout, KVPool
from kvtransfer import sender as sender_module
from kvtransfer.channel import InprocServer
from kvtransfer.cuda_window import CudaWindows
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.transports.cuda_ipc import CudaIpc
from kvtransfer.window_arena import WindowArena
from protocol.codec import decode
from protocol.kv_messages import CudaIpcHandle, WindowRelease
from tests.test_window_arena import Clock, CpuBuffer

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
GRANULE = 8 * LAYOUT.bytes_per_block


class FakeDevice:
    """Allocations and their "IPC handles": a handle maps the same tensor, as the real one maps the memory."""

    def __init__(self):
        self.made: list[CpuBuffer] = []
        self.mappings: list[CpuBuffer] = []
        self._by_handle: dict[bytes, CpuBuffer] = {}
        self._ids = itertools.count(1)

    def allocate(self, num_bytes: int) -> CpuBuffer:
        self.made.append(CpuBuffer(num_bytes, torch.zeros(num_bytes, dtype=torch.uint8)))
        return self.made[-1]

    def export(self, buffer: CpuBuffer) -> CudaIpcHandle:
        handle = next(self._ids).to_bytes(64, "little")
        self._by_handle[handle] = buffer
        return CudaIpcHandle(0, handle, buffer.num_bytes)

    def import_buffer(self, handle: CudaIpcHandle, device) -> CpuBuffer:
        exported = self._by_handle[handle.handle]
        assert handle.size_bytes == exported.num_bytes
        self.mappings.append(CpuBuffer(exported.num_bytes, exported.bytes()))
        return self.mappings[-1]


@dataclass(slots=True)
class Plane:
    rx: KVReceiver
    tx: KVSender
    device: FakeDevice
    clock: Clock
    registry: CollectorRegistry

    def __iter__(self):
        return iter((self.rx, self.tx, self.device))


@pytest.fixture
def plane(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(CudaIpc, "possible", lambda self, pair: pair.same_host)  # CPU pools stand in for GPU ones
    monkeypatch.setattr(sender_module.cuda_ipc, "import_buffer", device.import_buffer)
    server = InprocServer()
    pool = KVPool(LAYOUT, tensor=torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(1)))
    freed: list[int] = []
    clock, registry = Clock(), CollectorRegistry()  # one clock: the receiver's leases and its arena's grace
    rx = KVReceiver(pool, "tiny", server, freed.extend, TransferMetrics(registry), clock=clock)
    arena = WindowArena(device.allocate, granularity=GRANULE, release_grace_s=30.0, clock=clock)
    rx.windows = CudaWindows(LAYOUT, arena, device.export)
    source = KVPool(LAYOUT, tensor=torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(2)))
    tx = KVSender(source, "tiny", server.connect(), transports=("cuda_ipc",))
    monkeypatch.setattr(tx, "_reply_error", lambda reply: "")  # its "pool is not on a GPU" check
    tx.start_handshake()
    pump(rx, tx, lambda rx_events, tx_events: not tx.handshake_pending)
    assert tx.transport == "cuda_ipc"
    yield Plane(rx, tx, device, clock, registry)
    rx.close()
    assert all(b.data is None for b in device.made), "a window outlived the receiver"


def pump(rx: KVReceiver, tx: KVSender, until, steps: int = 200) -> tuple[list, list]:
    rx_events, tx_events = [], []
    for _ in range(steps):
        tx_events += tx.poll()
        rx_events += rx.poll()
        if until(rx_events, tx_events):
            return rx_events, tx_events
    raise AssertionError(f"not reached: {rx_events} {tx_events}")


def transfer(rx, tx, rid: str, src: list[int], dst: list[int]) -> None:
    rx.reserve(rid, 1, dst)
    tx.send(rid, 1, src, dst)
    tx.commit(rid, 1, first_token=5)
    rx_events, tx_events = pump(rx, tx, lambda r, t: r and t)
    assert [(e.ok, e.block_ids) for e in rx_events] == [(True, tuple(dst))]
    assert [e.ok for e in tx_events] == [True]
    assert rx.adopt(rid) == tuple(dst)


def test_blocks_land_through_a_window_and_the_window_comes_back_scrubbed(plane):
    rx, tx, device = plane
    before = rx.pool.tensor.clone()
    transfer(rx, tx, "r1", [0, 5, 6], [9, 3, 4])
    expected = before.clone()
    expected[:, :, [9, 3, 4]] = tx.pool.tensor[:, :, [0, 5, 6]]
    assert torch.equal(rx.pool.tensor, expected)  # exactly the reserved blocks, bit-exact
    assert [m.data is None for m in device.mappings] == [True]  # the sender closed its mapping
    pump(rx, tx, lambda r, t: rx.windows.arena.num_leased == 0)  # its WindowRelease came in
    arena = rx.windows.arena
    assert (arena.idle_bytes, arena.num_retired, len(device.made)) == (GRANULE, 0, 1)
    assert int(device.made[0].bytes().count_nonzero()) == 0  # scrubbed: the next peer reads nothing of r1

    transfer(rx, tx, "r2", [1], [12])  # the next transfer reuses the one allocation
    assert len(device.made) == 1 and len(device.mappings) == 2
    assert torch.equal(rx.pool.tensor[:, :, 12], tx.pool.tensor[:, :, 1])


def test_a_grant_without_a_handle_fails_the_transfer(plane, monkeypatch):
    """A cuda_ipc grant must carry the window's handle; one without (a shm-style name) maps nothing."""
    rx, tx, device = plane
    real_open = rx.windows.open

    def open_without_handle(rid, generation, block_ids, key):
        grant = real_open(rid, generation, block_ids, key)
        grant.cuda_window = None
        return grant

    monkeypatch.setattr(rx.windows, "open", open_without_handle)
    rx.reserve("r3", 1, [7])
    tx.send("r3", 1, [0], [7])
    _, tx_events = pump(rx, tx, lambda r, t: t)
    assert [(e.ok, e.reason) for e in tx_events] == [(False, "a window that is not cuda_ipc's")]
    assert device.mappings == []


def test_a_peer_not_assigned_the_range_gets_no_window(plane):
    """The chaos attack "shm write outside the reserved blocks" for cuda_ipc: a connection whose key is not
    the one the range was reserved for asks for its window: refused, nothing allocated, nothing exported."""
    rx, tx, device = plane
    before = rx.pool.tensor.clone()
    rx.reserve("r4", 1, [8], sender_key="the assigned prefill worker's key")
    tx.send("r4", 1, [0], [8])
    _, tx_events = pump(rx, tx, lambda r, t: t)
    assert [(e.ok, e.reason) for e in tx_events] == [(False, "rejected by receiver: not_assigned")]
    assert (len(rx.windows), rx.windows.arena.num_leased, device.made, device.mappings) == (0, 0, [], [])
    assert torch.equal(rx.pool.tensor, before)
    assert rx.rejects.counts["not_assigned"] == 1


def test_a_window_never_released_is_freed_after_the_grace_counted_and_not_reused(plane):
    rx, tx, device = plane
    clock = plane.clock
    send = tx.channel.send
    tx.channel.send = lambda frames: True if isinstance(decode(frames[0]), WindowRelease) else send(frames)
    transfer(rx, tx, "r5", [2], [11])  # committed; the sender keeps its mapping and says nothing
    assert (rx.windows.arena.num_leased, device.made[0].data is None) == (1, False)
    clock.now += 29.9
    rx.poll()
    assert rx.windows.arena.num_leased == 1
    clock.now += 0.1
    rx.poll()
    assert (rx.windows.arena.num_leased, rx.windows.arena.num_retired, rx.windows.arena.idle_bytes) == (0, 1, 0)
    assert device.made[0].data is None  # freed, not handed to anyone
    assert plane.registry.get_sample_value("pdserve:kv_windows_unreleased_total") == 1
    transfer(rx, tx, "r6", [3], [10])
    assert len(device.made) == 2  # the next transfer got a new allocation
