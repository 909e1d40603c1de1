"""CUDA memory another process may map: allocations of their own, each with its own IPC handle.

A per-transfer window (kvtransfer/cuda_window.py) must show its peer nothing but the window. torch's
``UntypedStorage._share_cuda_()`` cannot give that: its handle names the caching allocator's whole
segment (the offset only locates the tensor inside it), so a window carved from torch's cache would hand
over its neighbours: activations, the pool, other transfers' windows. Here each buffer is one
``cuMemAlloc`` of a multiple of 2 MiB (a smaller allocation may share its 2 MiB page with another, which
an IPC mapping then exposes: CUDA programming guide, "Interprocess Communication"), exported with
``cuIpcGetMemHandle``. The peer maps exactly that allocation (``cuIpcOpenMemHandle``) and checks that
the range it got (``cuMemGetAddressRange``) is the size the grant claims.

The driver API is called through ctypes (libcuda.so.1 is wherever a GPU is): torch has no allocation
outside its cache, and five calls do not justify a dependency (cuda-python). Each call runs with the
device's primary context current: the one torch's runtime uses. The handle travels as a typed record
(``CudaIpcHandle``), never pickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

import torch

from kvtransfer.window_arena import WindowCapacityError
from protocol.kv_messages import CudaIpcHandle

IPC_GRANULARITY = 2 * 2**20
HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: the peer may live on another GPU


class CudaDriverError(RuntimeError):
    pass


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@dataclass(slots=True)
class DeviceBuffer:
    """One allocation of its own (``imported``: a peer's, mapped here). ``bytes()`` is a flat uint8 view;
    every view must be dropped before ``free``, which frees (or unmaps) the memory under them."""

    device: int
    ptr: int
    num_bytes: int
    imported: bool
    view: torch.Tensor | None = None

    def bytes(self) -> torch.Tensor:
        assert self.view is not None, "buffer already freed"
        return self.view

    def free(self) -> None:
        if self.view is None:
            return
        torch.cuda.synchronize(self.device)  # no queued copy may touch it once it is gone
        self.view = None
        with _current(self.device) as lib:
            if self.imported:
                _check(lib.cuIpcCloseMemHandle(ctypes.c_uint64(self.ptr)), "cuIpcCloseMemHandle")
            else:
                _check(lib.cuMemFree_v2(ctypes.c_uint64(self.ptr)), "cuMemFree")


def allocate(device: int, num_bytes: int) -> DeviceBuffer:
    """A zeroed allocation of ``num_bytes`` (a multiple of ``IPC_GRANULARITY``) on ``device``."""
    assert num_bytes > 0 and num_bytes % IPC_GRANULARITY == 0, num_bytes
    ptr = ctypes.c_uint64()
    for attempt in range(2):
        with _current(device) as lib:
            status = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(num_bytes))
        if status != _OUT_OF_MEMORY or attempt:
            break
        torch.cuda.empty_cache()  # torch's cache may hold what is free; give it back once and retry
    if status == _OUT_OF_MEMORY:
        raise WindowCapacityError(f"GPU {device} has no {num_bytes} bytes ({num_bytes / 2**20:.0f} MiB) free")
    _check(status, "cuMemAlloc")
    buffer = DeviceBuffer(device, ptr.value, num_bytes, imported=False, view=_wrap(ptr.value, num_bytes))
    buffer.view.zero_()
    return buffer


def export(buffer: DeviceBuffer) -> CudaIpcHandle:
    assert not buffer.imported
    handle = _IpcMemHandle()
    with _current(buffer.device) as lib:
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(buffer.ptr)), "cuIpcGetMemHandle")
    return CudaIpcHandle(buffer.device, bytes(handle), buffer.num_bytes)  # all 64 bytes, NULs included


def import_buffer(handle: CudaIpcHandle, device: int) -> DeviceBuffer:
    """Map a peer's allocation into ``device``'s context; raises ValueError when the handle is malformed
    or the mapped range is not the size it claims (a peer's values are checked, not trusted)."""
    if len(handle.handle) != HANDLE_BYTES or not 0 < handle.size_bytes <= 2**40:
        raise ValueError(f"malformed CUDA IPC handle ({len(handle.handle)} bytes, size {handle.size_bytes})")
    raw = _IpcMemHandle.from_buffer_copy(handle.handle)
    ptr, base, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
    with _current(device) as lib:
        _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        status = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if status != 0 or base.value != ptr.value or size.value != handle.size_bytes:
            lib.cuIpcCloseMemHandle(ptr)
            raise ValueError(f"the mapped allocation has {size.value} bytes; the grant says {handle.size_bytes}")
    return DeviceBuffer(device, ptr.value, size.value, imported=True, view=_wrap(ptr.value, size.value))


def mapped_range(buffer: DeviceBuffer) -> tuple[int, int]:
    """(base, size) of the allocation ``buffer.ptr`` lies in, as the driver sees it (tests)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with _current(buffer.device) as lib:
        _check(
            lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(buffer.ptr)),
            "cuMemGetAddressRange",
        )
    return base.value, size.value


class _CudaArray:
    """``__cuda_array_interface__`` of a raw allocation, for ``torch.as_tensor`` (no copy; kept alive by it)."""

    def __init__(self, ptr: int, num_bytes: int):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def _wrap(ptr: int, num_bytes: int) -> torch.Tensor:
    return torch.as_tensor(_CudaArray(ptr, num_bytes))


@functools.cache
def _driver() -> ctypes.CDLL:
    torch.cuda.init()  # the runtime creates the primary contexts torch works in
    lib = ctypes.CDLL("libcuda.so.1")
    # The handle goes by value (a 64-byte struct): ctypes needs the signature for that.
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
    _check(lib.cuInit(0), "cuInit", lib)
    return lib


@functools.cache
def _primary_context(device: int) -> ctypes.c_void_p:
    lib, dev, ctx = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx


@contextlib.contextmanager
def _current(device: int):
    lib = _driver()
    _check(lib.cuCtxPushCurrent_v2(_primary_context(device)), "cuCtxPushCurrent")
    try:
        yield lib
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def _check(status: int, what: str, lib: ctypes.CDLL | None = None) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        (lib or _driver()).cuGetErrorName(status, ctypes.byref(name))
        raise CudaDriverError(f"{what}: {(name.value or b'').decode() or status}")
