"""Which GPUs each worker of ``pdserve serve`` sees: ``--devices 0,1,...`` (or ``cluster.devices``).

Workers take turns over the list, prefill workers first, then decode workers: with ``0,1`` and one
worker of each, prefill-0 runs on GPU 0 and decode-0 on GPU 1; a third worker shares GPU 0 again.

A worker's own GPU comes first in its CUDA_VISIBLE_DEVICES, so it is that process's ``cuda:0``, where
the engine puts weights and KV pool. The other listed GPUs stay visible after it, in list order: the
cuda_ipc transport maps each transfer's window (on the decode worker's GPU) into the prefill worker,
and CUDA can only open an IPC handle to memory on a device the importing process can see (through peer access). Without
``--devices`` the workers inherit this process's environment unchanged.
"""

from __future__ import annotations


def parse_devices(text: str) -> list[str]:
    """``"0,1"`` -> ``["0", "1"]``; entries are what CUDA_VISIBLE_DEVICES takes (indices or GPU-UUIDs)."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices {text!r} names a GPU twice")
    return devices


def visible_devices(devices: list[str], worker_index: int) -> str:
    """CUDA_VISIBLE_DEVICES of the ``worker_index``-th worker: its turn's GPU, then the others."""
    own = worker_index % len(devices)
    return ",".join(devices[own:] + devices[:own])


def placement(devices: list[str], worker_names: list[str]) -> dict[str, str]:
    """Worker name -> CUDA_VISIBLE_DEVICES, for names in launch order (prefill pool, then decode)."""
    if not devices:
        return {}
    return {name: visible_devices(devices, i) for i, name in enumerate(worker_names)}
