"""Block FP8 quantization on the GPU without torch: a CUDA kernel compiled at run time
(NVRTC) and launched through the driver, for a load that quantizes (preloadd/copy_loader.py).

A daemon that quantizes with torch waits for `import torch` (4-6 s on an H200 host,
longer than reading V2-Lite's files) before its first tensor. This kernel needs only
the driver and NVRTC (shipped with torch's CUDA wheels, found by path, never imported),
so the weights are quantized as they arrive, on each loader thread's stream.

The reference is kernels/fp8.py's quantize_block, as torch computes it on a GPU: per
128 x 128 block, scale_inv = max(amax, 1e-12) * (1/448) (torch divides a tensor by a
scalar as a multiplication by its reciprocal), then q = e4m3(clamp(w / scale_inv,
-448, 448)) rounded to nearest even. The GPU test compares the two byte for byte.
e4m3 conversion in hardware needs compute capability 8.9 (Ada, Hopper) or newer.
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

MIN_CAPABILITY = (8, 9)
KERNEL = "quantize_fp8_block"
SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) quantize_fp8_block(
    const unsigned short* __restrict__ w, unsigned char* __restrict__ q, float* __restrict__ scale_inv,
    long long n, long long k)
{
    // One thread block per 128 x 128 block of the bf16 matrix w [n, k]; 256 threads, two rows at a time.
    const long long r0 = (long long)blockIdx.y * 128, c = (long long)blockIdx.x * 128 + (threadIdx.x & 127);
    const int first = threadIdx.x >> 7;
    float amax = 0.0f;
    for (int i = first; i < 128; i += 2) {
        const long long r = r0 + i;
        if (r < n && c < k) amax = fmaxf(amax, fabsf(__uint_as_float((unsigned)w[r * k + c] << 16)));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    __shared__ float warp_max[8];
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = warp_max[0];
    for (int j = 1; j < 8; ++j) amax = fmaxf(amax, warp_max[j]);
    const float s = fmaxf(amax, 1e-12f) * (1.0f / 448.0f);
    if (threadIdx.x == 0) scale_inv[(long long)blockIdx.y * gridDim.x + blockIdx.x] = s;
    for (int i = first; i < 128; i += 2) {
        const long long r = r0 + i;
        if (r < n && c < k) {
            const float x = fminf(fmaxf(__uint_as_float((unsigned)w[r * k + c] << 16) / s, -448.0f), 448.0f);
            unsigned short pair;
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
            q[r * k + c] = (unsigned char)(pair & 0xff);
        }
    }
}
"""
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


def _nvrtc_candidates() -> list[str]:
    """libnvrtc wherever it may be: the linker's path, torch's CUDA wheels (nvidia/*/lib),
    a CUDA toolkit."""
    found = [ctypes.util.find_library("nvrtc")]
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"), reverse=True)
    return [f for f in found if f and "builtins" not in f]


_lock = threading.Lock()
_compiling = threading.Lock()
_nvrtc_lib: ctypes.CDLL | None = None


def _nvrtc() -> ctypes.CDLL | None:
    global _nvrtc_lib
    with _lock:
        if _nvrtc_lib is None:
            for path in _nvrtc_candidates():
                try:
                    _nvrtc_lib = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
        return _nvrtc_lib


def capability(ordinal: int) -> tuple[int, int]:
    cu, dev, major, minor = _cu(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        raise RuntimeError(f"cuda:{ordinal}: the CUDA driver does not know it")
    cu.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    cu.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return major.value, minor.value


def available(ordinal: int) -> bool:
    """Whether GPU `ordinal` can quantize here: e4m3 in hardware, NVRTC found, and the
    kernel compiled for it (once per process; a load decides by this, so a failure to
    compile is known before anything is loaded, and torch quantizes instead)."""
    try:
        if capability(ordinal) < MIN_CAPABILITY or _nvrtc() is None:
            return False
    except (OSError, RuntimeError):  # (no driver, no such GPU: the load says so)
        return False
    with _compiling:  # (a daemon's start compiles it in a thread beside its imports: cli/start.py)
        return _compiles(ordinal)


@functools.cache
def _compiles(ordinal: int) -> bool:
    """Whether the kernel compiles for GPU `ordinal`: tried once per process, and a failure
    said once in the log, whichever thread asks first."""
    try:
        _cubin(ordinal)
        return True
    except RuntimeError as e:
        log.warning("fp8 quantized with torch, not by our kernel: %s", e)
        return False


@functools.cache
def _cubin(ordinal: int) -> bytes:
    """The kernel's cubin for GPU `ordinal`'s architecture."""
    nv, (major, minor) = _nvrtc(), capability(ordinal)
    if nv is None:
        raise RuntimeError("NVRTC (libnvrtc) not found: install torch's CUDA wheels or a CUDA toolkit")
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), f"{KERNEL}.cu".encode(), 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = (ctypes.c_char_p * 2)(f"--gpu-architecture=sm_{major}{minor}".encode(), b"--std=c++17")
        if nv.nvrtcCompileProgram(prog, 2, options) != 0:
            size = ctypes.c_size_t()
            nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {KERNEL} for sm_{major}{minor}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if nv.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0:
            raise RuntimeError("nvrtcGetCUBINSize failed")
        cubin = ctypes.create_string_buffer(size.value)
        if nv.nvrtcGetCUBIN(prog, cubin) != 0:
            raise RuntimeError("nvrtcGetCUBIN failed")
        return cubin.raw
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


class Fp8BlockQuantizer:
    """The kernel loaded into GPU `ordinal`'s primary context; `launch` from any thread."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        cubin = _cubin(ordinal)
        make_current(ordinal)
        cu, self.module, self.function = _cu(), ctypes.c_void_p(), ctypes.c_void_p()
        if cu.cuModuleLoadData(ctypes.byref(self.module), cubin) != 0:
            raise RuntimeError(f"cuda:{ordinal}: cuModuleLoadData refused the {KERNEL} cubin")
        if cu.cuModuleGetFunction(ctypes.byref(self.function), self.module, KERNEL.encode()) != 0:
            raise RuntimeError(f"cuda:{ordinal}: no {KERNEL} in its module")

    def launch(self, stream: ctypes.c_void_p | int, src: int, q: int, scale_inv: int, rows: int, cols: int) -> None:
        """Quantize the bf16 matrix [rows, cols] at device address `src` into e4m3 at `q`
        and float32 block scales [ceil(rows/128), ceil(cols/128)] at `scale_inv`, in
        `stream`'s order (`src` must stay as it is until the stream passes this point)."""
        args = [ctypes.c_uint64(src), ctypes.c_uint64(q), ctypes.c_uint64(scale_inv), ctypes.c_longlong(rows),
                ctypes.c_longlong(cols)]
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))  # (each argument's address)
        grid = (-(-cols // 128), -(-rows // 128), 1)
        stream = ctypes.c_void_p(getattr(stream, "value", stream))  # (a bare int would go as a 32-bit int)
        result = _cu().cuLaunchKernel(self.function, *grid, 256, 1, 1, 0, stream, params, None)
        if result != 0:
            raise RuntimeError(f"cuda:{self.ordinal}: cuLaunchKernel({KERNEL}) failed: CUDA error {result}")

    def close(self) -> None:
        if self.module:
            make_current(self.ordinal)
            _cu().cuModuleUnload(self.module)
            self.module = ctypes.c_void_p()
