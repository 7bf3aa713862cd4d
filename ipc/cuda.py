"""CUDA arenas through the driver API (ctypes over libcuda; imported only for CUDA).

cuda-vmm (default): one VMM allocation exported as a POSIX fd. The daemon fills it,
then drops its own read-write mapping and keeps only the fd; workers import the fd
and map it read-only (cuMemSetAccess with PROT_READ), so a stray write faults in the
writer alone. The memory lives while any holder of the fd or an import lives.

cuda-ipc (opt-in): a legacy cudaIpc handle (64 bytes) of one allocation per arena,
carried in the manifest; mapped read-write, and gone when the daemon exits.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import numpy as np

from preload.ipc.devices import driver as _cu
from preload.ipc.devices import make_current as _make_current
from preload.ipc.devices import memory_info
from preload.ipc.devices import ordinal as _ordinal
from preload.ipc.layout import ArenaError, TensorEntry, check_part, check_planned
from preload.ipc.manifest import ArenaInfo
from preload.ipc.staging import Staging
from preload.kernels.precision import FP8, QUANT_BLOCK

if TYPE_CHECKING:  # the daemon makes, fills (write_part) and seals a cuda-vmm arena without it
    import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # bytes, not a C string: NULs included


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cu().cuGetErrorName(result, ctypes.byref(name))
        raise ArenaError(f"{call} failed: {(name.value or b'?').decode()} ({result})")


def _device_context(device: torch.device) -> int:
    """Make torch's context for `device` current on this thread; return its ordinal."""
    import torch

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(ordinal)
    torch.cuda.init()
    torch.empty(1, device=device)  # forces the primary context into existence
    return ordinal


def _torch_device(ordinal: int) -> torch.device:
    import torch

    return torch.device("cuda", ordinal)


def _synchronize(ordinal: int) -> None:
    """Wait for all work in the device's primary context, every stream (torch's included)."""
    _make_current(ordinal)
    _check(_cu().cuCtxSynchronize(), "cuCtxSynchronize")


class _CudaBuffer:
    """A raw device range, viewable by torch through __cuda_array_interface__. (torch
    rejects the interface's read-only flag; read-only maps are enforced by the driver.)"""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _as_tensor(ptr: int, size: int, ordinal: int) -> torch.Tensor:
    import torch

    return torch.as_tensor(_CudaBuffer(ptr, size), device=f"cuda:{ordinal}")


def _copy_into(base: torch.Tensor, entry: TensorEntry, tensor: torch.Tensor) -> None:
    import torch

    check_planned(entry, tensor)
    src = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
    base[entry.offset : entry.offset + entry.nbytes].copy_(src, non_blocking=True)


def _copy_from_host(ptr: int, ordinal: int, entry: TensorEntry, at: int, data: memoryview) -> None:
    """Host bytes of `entry` from byte `at` on into the arena at `ptr`, copied before this
    returns (from pageable memory: the driver stages them), from any thread, without torch."""
    check_part(entry, at, len(data))
    if not len(data):
        return
    _make_current(ordinal)
    src = np.frombuffer(data, dtype=np.uint8).ctypes.data  # (a read-only mapping has an address too)
    _check(_cu().cuMemcpyHtoD_v2(ctypes.c_uint64(ptr + entry.offset + at), ctypes.c_void_p(src), ctypes.c_size_t(len(data))),
           "cuMemcpyHtoD")


def _prop(ordinal: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


def _map(handle: int, size: int, ordinal: int, flags: int) -> int:
    """Reserve an address range, map the allocation there, grant this device `flags`."""
    ptr = ctypes.c_uint64()
    _check(_cu().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
    try:
        _map_at(ptr.value, handle, size, ordinal, flags)
    except ArenaError:
        _unmap(ptr.value, size)
        raise
    return ptr.value


def _map_at(ptr: int, handle: int, size: int, ordinal: int, flags: int) -> None:
    """Map the allocation into the reserved range at `ptr`, grant this device `flags`."""
    cu = _cu()
    _check(cu.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle), ctypes.c_ulonglong(0)), "cuMemMap")
    desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal), flags)
    rc = cu.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
    if rc != 0:
        cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        _check(rc, "cuMemSetAccess")


def _unmap(ptr: int, size: int) -> None:
    cu = _cu()
    cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    cu.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size))


def granularity(ordinal: int) -> int:
    g = ctypes.c_size_t()
    _check(_cu().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(ordinal)), 0), "cuMemGetAllocationGranularity")
    return g.value


def check_device_memory(size: int, ordinal: int) -> None:
    device = f"cuda:{ordinal}"
    free, _ = memory_info(device)
    if size > free:
        raise ArenaError(f"not enough memory on {device} for the arena: need {size / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")


class _VmmHolder:
    """What a process holds of a VMM allocation: a mapping, a handle, an fd. Closing
    lets go of each; the memory itself goes when the last holder in any process does."""

    ptr: int | None = None
    handle: int | None = None
    fd: int = -1
    base: torch.Tensor | None = None

    def close(self) -> None:
        self.base = None
        if self.ptr is not None:
            _synchronize(self.ordinal)  # no kernel may still read the range
            _unmap(self.ptr, self.size)
            self.ptr = None
        if self.handle is not None:
            _cu().cuMemRelease(ctypes.c_uint64(self.handle))
            self.handle = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class VmmArena(_VmmHolder):
    """Daemon side of a cuda-vmm arena: made, filled and sealed through the driver alone
    (write_part); `write` of torch tensors imports torch (a load that quantizes has it)."""

    transport = "cuda-vmm"

    def __init__(self, size: int, device: str):
        self.ordinal = _ordinal(device)
        self._staging: Staging | None = Staging(self.ordinal)  # (no CUDA call until a thread sends)
        _make_current(self.ordinal)
        g = granularity(self.ordinal)
        self.size = -(-size // g) * g
        check_device_memory(self.size, self.ordinal)
        cu, handle = _cu(), ctypes.c_uint64()
        _check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(_prop(self.ordinal)), ctypes.c_ulonglong(0)), "cuMemCreate")
        self.handle = handle.value
        try:
            fd = ctypes.c_int(-1)
            _check(cu.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(self.handle), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
            self.fd = fd.value
            os.set_inheritable(self.fd, False)
            self.ptr = _map(self.handle, self.size, self.ordinal, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        except BaseException:
            self.close()
            raise

    def as_tensor(self) -> torch.Tensor:
        """The arena as a flat uint8 tensor (made on first use: it imports torch)."""
        if self.base is None:
            self.base = _as_tensor(self.ptr, self.size, self.ordinal)
        return self.base

    def write(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        _copy_into(self.as_tensor(), entry, tensor)

    def write_part(self, entry: TensorEntry, at: int, data: memoryview) -> None:
        """Host bytes of `entry` from byte `at` on, from any thread, through that thread's
        pinned buffers (ipc/staging.py): `data` may be reused on return, the copy lands by seal()."""
        check_part(entry, at, len(data))
        self._staging.send(self.ptr + entry.offset + at, data)

    def stage_part(self, at: int, data: memoryview, total: int) -> None:
        """Bytes `at`.. of a source tensor of `total` bytes, to be quantized by
        write_fp8_block, into this thread's device scratch (ipc/staging.py)."""
        self._staging.stage(at, data, total)

    def write_fp8_block(self, q: TensorEntry, scale_inv: TensorEntry) -> None:
        """The bf16 matrix this thread staged (stage_part), quantized on the GPU into `q`
        (e4m3) and `scale_inv` (float32 per 128 x 128 block), without torch."""
        rows, cols = q.shape
        blocks = (-(-rows // QUANT_BLOCK[0]), -(-cols // QUANT_BLOCK[1]))
        if q.dtype != FP8 or scale_inv.dtype != "float32" or scale_inv.shape != blocks:
            raise ArenaError(f"{q.name}: {q.dtype} {q.shape} with {scale_inv.dtype} {scale_inv.shape} scales: no block fp8")
        self._staging.quantize_staged(self.ptr + q.offset, self.ptr + scale_inv.offset, rows, cols)

    def check_finite(self, entry: TensorEntry, tag: int) -> None:
        """`entry`'s values checked for NaN and Inf on the GPU, after this thread's copies so
        far (ipc/finite_device.py); `tag` (non-zero) names it in first_nonfinite."""
        self._staging.check_finite(self.ptr + entry.offset, entry.nbytes, entry.dtype, tag)

    def check_staged_finite(self, nbytes: int, dtype: str, tag: int) -> None:
        """check_finite of the source tensor this thread staged (stage_part)."""
        self._staging.check_staged_finite(nbytes, dtype, tag)

    def first_nonfinite(self) -> int:
        """The smallest tag of the tensors checked and found NaN or Inf, once every copy
        and check is done; 0 if none."""
        return self._staging.first_nonfinite()

    def _finish_staging(self) -> None:
        if self._staging is not None:
            self._staging.finish()
            self._staging = None

    def close(self) -> None:
        self._finish_staging()
        super().close()

    def seal(self) -> None:
        """Drop the daemon's own writable mapping: from now on only read-only maps exist."""
        self._finish_staging()
        _synchronize(self.ordinal)
        self.base = None
        _unmap(self.ptr, self.size)
        self.ptr = None
        _cu().cuMemRelease(ctypes.c_uint64(self.handle))  # the exported fd keeps the memory alive
        self.handle = None

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.transport, self.size, self.ordinal)

    def fds(self) -> list[int]:
        return [self.fd]


class VmmMapping(_VmmHolder):
    """Worker side: the arena imported from its fd and mapped read-only (a worker's own
    KV memory, handed on to the next worker of its slot: writable)."""

    def __init__(self, info: ArenaInfo, fds: list[int], writable: bool = False):
        self.size, self.ordinal = info.size, info.device
        self.fd = fds[0]
        self.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else CU_MEM_ACCESS_FLAGS_PROT_READ
        try:
            _device_context(_torch_device(self.ordinal))  # (a worker: torch's current device too)
            self.handle = _import(self.fd)
            self.ptr = _map(self.handle, self.size, self.ordinal, self.flags)
        except BaseException:
            self.close()
            raise
        self.base = _as_tensor(self.ptr, self.size, self.ordinal)

    def let_go_keeping_address(self) -> None:
        """Unmap the allocation and let go of it, its address range kept reserved: what views
        it and what graphs read it stay valid once map_again puts an allocation of the same
        size there (a spare kept through a sleep, whose device state the driver can checkpoint
        only once it maps no other process's memory: ipc/cuda_checkpoint.py). Nothing may
        read the range meanwhile."""
        _synchronize(self.ordinal)
        _check(_cu().cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemUnmap")
        _cu().cuMemRelease(ctypes.c_uint64(self.handle))
        self.handle = None
        os.close(self.fd)
        self.fd = -1

    def map_again(self, info: ArenaInfo, fds: list[int]) -> None:
        """Map the allocation `fds` names (of the size this one had) where this one was."""
        if self.handle is not None or info.size != self.size or info.device != self.ordinal:
            raise ArenaError(f"cannot map {info.size} bytes on device {info.device} where {self.size} bytes on device"
                             f" {self.ordinal} {'are' if self.handle is not None else 'were'} mapped")
        handle = _import(fds[0])
        try:
            _map_at(self.ptr, handle, self.size, self.ordinal, self.flags)
        except BaseException:
            _cu().cuMemRelease(ctypes.c_uint64(handle))
            raise
        self.fd, self.handle = fds[0], handle  # (taken only now: on a failure the caller still has them)


def _import(fd: int) -> int:
    handle = ctypes.c_uint64()
    _check(_cu().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
    return handle.value


class IpcArena:
    """Daemon side of a legacy cuda-ipc arena: one cuMemAlloc, one IPC handle."""

    transport = "cuda-ipc"

    def __init__(self, size: int, device: str):
        self.ordinal = _ordinal(device)
        _make_current(self.ordinal)
        self.size = size
        check_device_memory(size, self.ordinal)
        ptr = ctypes.c_uint64()
        _check(_cu().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        self.ptr = ptr.value
        ipc = CUipcMemHandle()
        _check(_cu().cuIpcGetMemHandle(ctypes.byref(ipc), ctypes.c_uint64(self.ptr)), "cuIpcGetMemHandle")
        self.ipc_handle = bytes(ipc.reserved)
        self.base = _as_tensor(self.ptr, size, self.ordinal)

    def write(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        _copy_into(self.base, entry, tensor)

    def write_part(self, entry: TensorEntry, at: int, data: memoryview) -> None:
        _copy_from_host(self.ptr, self.ordinal, entry, at, data)

    def seal(self) -> None:
        _synchronize(self.ordinal)

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.transport, self.size, self.ordinal, self.ipc_handle)

    def fds(self) -> list[int]:
        return []

    def close(self) -> None:
        self.base = None
        if self.ptr is not None:
            _synchronize(self.ordinal)
            _cu().cuMemFree_v2(ctypes.c_uint64(self.ptr))
            self.ptr = None


class IpcMapping:
    def __init__(self, info: ArenaInfo, fds: list[int]):
        for fd in fds:
            os.close(fd)
        self.size, self.ordinal = info.size, info.device
        _device_context(_torch_device(self.ordinal))
        ipc = CUipcMemHandle.from_buffer_copy(info.ipc_handle)
        ptr = ctypes.c_uint64()
        open_handle = _cu().cuIpcOpenMemHandle_v2
        open_handle.argtypes = [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle, ctypes.c_uint]  # the handle goes by value
        _check(open_handle(ctypes.byref(ptr), ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        self.ptr = ptr.value
        self.base = _as_tensor(self.ptr, self.size, self.ordinal)

    def close(self) -> None:
        self.base = None
        if self.ptr is not None:
            _synchronize(self.ordinal)
            _cu().cuIpcCloseMemHandle(ctypes.c_uint64(self.ptr))
            self.ptr = None
