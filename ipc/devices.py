"""Which device the daemon means, known without importing torch.

The daemon resolves `--device auto` and takes its per-GPU lock before it knows whether it
will load a checkpoint (torch: seconds to import) or take the weights back from a keeper
(no torch at all: on an H200 host `import torch` alone takes 4-6 s, the whole re-adopt
budget several times over). The CUDA driver answers both through ctypes: cuInit and a
device query cost a fraction of a second and make no context (no device memory).
Workers resolve their `--device` here too, so that both name a device alike.
"""

from __future__ import annotations

import ctypes
import re

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_driver: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    """libcuda, loaded once (OSError where no NVIDIA driver is installed)."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def cuda_device_count() -> int:
    """The GPUs CUDA shows this process (CUDA_VISIBLE_DEVICES applies); 0 without a driver."""
    try:
        cu = driver()
    except OSError:
        return 0
    n = ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def resolve_device_name(device: str) -> str:
    """`auto`: "cuda" when CUDA shows a GPU, else "cpu"; any other name as given, checked.
    (The names torch prints for the same devices: manifests compare them as strings.)"""
    if device == "auto":
        return "cuda" if cuda_device_count() else "cpu"
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device {device!r}: choose auto, cpu, cuda or cuda:N")
    return device


def data_parallel_devices(device: str, size: int) -> list[str]:
    """The device of each data-parallel rank: `device` alone for one; for more, consecutive
    GPUs from `device`'s (cuda:N, N+1, ...), or the CPU for each."""
    if size == 1 or device == "cpu":
        return [device] * size
    first, count = ordinal(device), cuda_device_count()
    if first + size > count:
        raise ValueError(f"--data-parallel-size {size} from {device} needs GPUs {first} to {first + size - 1}: CUDA"
                         f" shows this process {count}")
    return [f"cuda:{first + k}" for k in range(size)]


def ordinal(device: str) -> int:
    """cuda:N -> N; "cuda" is cuda:0, the first GPU CUDA shows this process."""
    return int(device.partition(":")[2] or 0)


def gpu_uuid(device: str) -> str:
    """The UUID of GPU `device` ("cuda" is cuda:0), as torch's device properties print it."""
    ordinal_, count = ordinal(device), cuda_device_count()
    if ordinal_ >= count:
        raise ValueError(f"device {device}: CUDA shows this process {count} GPU{'s' * (count != 1)}")
    cu, handle, uuid = driver(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
    if cu.cuDeviceGet(ctypes.byref(handle), ordinal_) != 0 or cu.cuDeviceGetUuid(ctypes.byref(uuid), handle) != 0:
        raise ValueError(f"device {device}: the CUDA driver gives no UUID for it")
    h = bytes(uuid).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_primary: dict[int, ctypes.c_void_p] = {}


def make_current(index: int) -> None:
    """Make GPU `index`'s primary context (the one torch uses) current on this thread,
    through the driver alone: retained once per process and never released, as torch
    does. RuntimeError if the driver refuses."""
    cu = driver()
    if index not in _primary:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), index) != 0 \
                or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            raise RuntimeError(f"cuda:{index}: the CUDA driver gives no context for it")
        _primary.setdefault(index, ctx)
    if cu.cuCtxSetCurrent(_primary[index]) != 0:
        raise RuntimeError(f"cuda:{index}: cuCtxSetCurrent failed")


def memory_info(device: str) -> tuple[int, int]:
    """(free, total) bytes of GPU `device` ("cuda" is cuda:0), as torch.cuda.mem_get_info."""
    make_current(ordinal(device))
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if driver().cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
        raise RuntimeError(f"{device}: cuMemGetInfo failed")
    return free.value, total.value
