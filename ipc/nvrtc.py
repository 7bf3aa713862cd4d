"""CUDA kernels compiled at run time (NVRTC) and launched through the driver, without torch.

A daemon that computes with torch waits for `import torch` (4-6 s on an H200 host, longer
than reading V2-Lite's files) before its first tensor. The kernels a load needs (fp8
quantization: ipc/fp8_device.py; the NaN/Inf check: ipc/finite_device.py) need only the
driver and NVRTC, shipped with torch's CUDA wheels and found by path, never imported.
Each kernel is compiled once per process for the GPU's architecture; one that does not
compile is said once in the log, and the load does that part some other way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import os
import sys
import threading

from preload.ipc.devices import driver as _cu
from preload.ipc.devices import make_current

log = logging.getLogger(__name__)

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


def _candidates() -> list[str]:
    """libnvrtc wherever it may be: the linker's path, torch's CUDA wheels (nvidia/*/lib,
    nvidia/cu13/lib), a CUDA toolkit."""
    found = [ctypes.util.find_library("nvrtc")]
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"), reverse=True)
    return [f for f in found if f and "builtins" not in f]


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL | None:
    """libnvrtc, loaded once; None where there is none."""
    global _library
    with _lock:
        if _library is None:
            for path in _candidates():
                try:
                    _library = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
        return _library


def capability(ordinal: int) -> tuple[int, int]:
    cu, dev, major, minor = _cu(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        raise RuntimeError(f"cuda:{ordinal}: the CUDA driver does not know it")
    cu.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    cu.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return major.value, minor.value


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """`source` compiled for `arch` (sm_90, ...) into a cubin; RuntimeError with NVRTC's log
    if it does not compile."""
    nv = library()
    if nv is None:
        raise RuntimeError("NVRTC (libnvrtc) not found: install torch's CUDA wheels or a CUDA toolkit")
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = (ctypes.c_char_p * 2)(f"--gpu-architecture={arch}".encode(), b"--std=c++17")
        if nv.nvrtcCompileProgram(prog, 2, options) != 0:
            size = ctypes.c_size_t()
            nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}: {text.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if nv.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0:
            raise RuntimeError("nvrtcGetCUBINSize failed")
        cubin = ctypes.create_string_buffer(size.value)
        if nv.nvrtcGetCUBIN(prog, cubin) != 0:
            raise RuntimeError("nvrtcGetCUBIN failed")
        return cubin.raw
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


_compiling = threading.Lock()


def cubin(source: str, name: str, ordinal: int, instead: str) -> bytes | None:
    """Kernel `name` compiled for GPU `ordinal`, or None (said once in the log: "`instead`:
    why") if NVRTC is missing or refuses it. Compiled once per process, whichever thread
    asks first: a daemon's start compiles beside its imports (cli/start.py), the load
    asks again."""
    with _compiling:
        return _cached(source, name, ordinal, instead)


@functools.cache
def _cached(source: str, name: str, ordinal: int, instead: str) -> bytes | None:
    try:
        major, minor = capability(ordinal)
        return compile_cubin(source, name, f"sm_{major}{minor}")
    except (OSError, RuntimeError) as e:
        log.warning("%s: %s", instead, e)
        return None


def compiles(source: str, name: str, ordinal: int, instead: str, min_capability: tuple[int, int] = (0, 0)) -> bool:
    """Whether kernel `name` runs on GPU `ordinal`: the GPU has `min_capability` and the
    kernel compiles for it (cubin). A load decides by this before it begins, so that a
    kernel that cannot run is known before anything is loaded."""
    try:
        if capability(ordinal) < min_capability:
            return False
    except (OSError, RuntimeError):  # (no driver, no such GPU: the load says so)
        return False
    return cubin(source, name, ordinal, instead) is not None


class Kernel:
    """Kernel `name` of `source`, loaded into GPU `ordinal`'s primary context; `run` from
    any thread. Each kernel's own class says what its arguments are."""

    def __init__(self, source: str, name: str, ordinal: int, instead: str):
        self.name, self.ordinal = name, ordinal
        code = cubin(source, name, ordinal, instead)
        if code is None:
            raise RuntimeError(f"cuda:{ordinal}: the {name} kernel did not compile (see the log)")
        make_current(ordinal)
        cu, self.module, self.function = _cu(), ctypes.c_void_p(), ctypes.c_void_p()
        if cu.cuModuleLoadData(ctypes.byref(self.module), code) != 0:
            raise RuntimeError(f"cuda:{ordinal}: cuModuleLoadData refused the {name} cubin")
        if cu.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()) != 0:
            raise RuntimeError(f"cuda:{ordinal}: no {name} in its module")

    def run(self, stream: ctypes.c_void_p | int, grid: tuple[int, int], threads: int, *args) -> None:
        """The kernel over `grid` blocks of `threads`, with `args` (ctypes values), in
        `stream`'s order."""
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))  # (each argument's address)
        stream = ctypes.c_void_p(getattr(stream, "value", stream))  # (a bare int would go as a 32-bit int)
        result = _cu().cuLaunchKernel(self.function, grid[0], grid[1], 1, threads, 1, 1, 0, stream, params, None)
        if result != 0:
            raise RuntimeError(f"cuda:{self.ordinal}: cuLaunchKernel({self.name}) failed: CUDA error {result}")

    def close(self) -> None:
        if self.module:
            make_current(self.ordinal)
            _cu().cuModuleUnload(self.module)
            self.module = ctypes.c_void_p()
