"""How long a transfer's block copies take, apart from the rest of its life.

A transfer's wall time (first block to commit) spans the prefill chunks it rides beside, so bytes over
that time is a latency, not a bandwidth. The sender therefore keeps three figures per transfer:

- copy: the block copies themselves (the device copy into the transfer's window for cuda_ipc,
  the host copy for shm/loopback, the gather and device-to-host copy for the channel transports).
  On CUDA it is read from events recorded around the copy on the stream that runs it, so host
  launch time and queueing do not count; on CPU the same code path is timed with perf_counter.
- exposed: from ``commit`` (the last prefill chunk is done and its first token sampled) to the
  receiver's acknowledgement; the part of the transfer a request's TTFT waits for.
- span: from the first ``send`` to the acknowledgement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TransferTimes:
    started_at: float | None = None  # perf_counter at the first send
    commit_at: float | None = None  # perf_counter when the commit was queued
    copy_s: float = 0.0
    copied_bytes: int = 0


class CopyStopwatch:
    """Times one copy on ``device``: CUDA events on its current stream, else perf_counter."""

    __slots__ = ("_device", "_start", "_end", "_t0")

    def __init__(self, device: torch.device):
        self._device = device
        self._start = self._end = None
        self._t0 = 0.0

    def __enter__(self) -> CopyStopwatch:
        if self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._end is not None:
            self._end.record(torch.cuda.current_stream(self._device))
        else:
            self._t0 = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """The copy's duration; on CUDA this waits for the copy (the sender waits for it anyway, so the
        bytes land before the header that announces them)."""
        if self._end is None:
            return self._t0
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of a pool laid out [L, 2, num_blocks, bs, kvh, d]."""
    return pool[:, :, 0].numel() * pool.element_size()
