"""Export a CUDA pool once (at handshake) and map it in a peer process on the same host.

``UntypedStorage._share_cuda_()`` yields the IPC handle fields; they travel as a typed record
(``CudaIpcHandle``), never pickled. The importing side rebuilds the storage and views it as the pool.
"""

from __future__ import annotations

import torch

from protocol.kv_messages import CudaIpcHandle


def export_pool(tensor: torch.Tensor) -> CudaIpcHandle:
    assert tensor.is_cuda and tensor.is_contiguous() and tensor.storage_offset() == 0
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return CudaIpcHandle(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


def import_pool(handle: CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map the peer's pool (contiguous ``shape``); the handle names the device it lives on."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        handle.device,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    # storage_offset_bytes locates the storage inside the exporter's allocation; the rebuilt storage
    # already starts there, and the pool starts at its element 0 (export asserts it).
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    stride = torch.empty(shape, device="meta").stride()
    return torch._utils._rebuild_tensor(typed, 0, shape, stride)
