"""``/dev/shm`` capacity is checked before the shm KV pool is created: too little space is a warning that
names both sizes, and the pool stays private (peers get the zmq transport), never a SIGBUS later. Only
the capacity reader is replaced; the file creation, reservation and pool are real."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from decode_node.node import share_pool
from engine.kv.pool import KVLayout, KVPool
from kvtransfer import shm_pool
from kvtransfer.shm_pool import ShmCapacityError, create_shared

LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
POOL_BYTES = 2 * 2 * 8 * 4 * 2 * 8 * 4  # layers x K/V x blocks x block size x heads x head dim x float32


def pdserve_files() -> set[str]:
    return {n for n in os.listdir(shm_pool.SHM_DIR) if n.startswith(f"pdserve-kv-{os.getpid()}-")}


def test_a_pool_that_fits_is_shared_and_fully_reserved():
    before = pdserve_files()
    pool = KVPool(LAYOUT)
    shared = share_pool(pool, "auto")
    try:
        assert shared is not None and pool.tensor.data_ptr() == shared.tensor.data_ptr()
        stat = os.stat(os.path.join(shm_pool.SHM_DIR, shared.name))
        assert stat.st_size == POOL_BYTES and stat.st_blocks * 512 >= POOL_BYTES  # backed, not sparse
    finally:
        shared.unlink()
    assert pdserve_files() == before


def test_too_little_shm_keeps_the_pool_private_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(shm_pool, "shm_free_bytes", lambda directory=shm_pool.SHM_DIR: POOL_BYTES - 1)
    before = pdserve_files()
    pool = KVPool(LAYOUT)
    private = pool.tensor
    with caplog.at_level(logging.WARNING, logger="decode_node.node"):
        assert share_pool(pool, "shm") is None
    assert pool.tensor is private and pdserve_files() == before  # nothing left behind in /dev/shm
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"/dev/shm has {POOL_BYTES - 1} bytes free" in warning and f"needs {POOL_BYTES} " in warning
    assert "zmq transport" in warning


def test_create_shared_refuses_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(shm_pool, "shm_free_bytes", lambda directory=shm_pool.SHM_DIR: 100)
    with pytest.raises(ShmCapacityError, match=r"has 100 bytes free .*needs 128 "):
        create_shared((32,), torch.float32)


def test_the_capacity_reader_reads_the_filesystem():
    stats = os.statvfs("/dev/shm")
    assert shm_pool.shm_free_bytes() == pytest.approx(stats.f_bavail * stats.f_frsize, rel=0.01)
