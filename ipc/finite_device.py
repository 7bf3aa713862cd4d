"""The NaN/Inf check of a load into GPU memory, on the GPU: a kernel (compiled at run time,
ipc/nvrtc.py) reads a tensor where its copies put it, in the loader thread's stream, and
leaves a tag in a device word if any value is NaN or infinite.

On the host the check is a pass of its own over every byte (checkpoint/finite.py), a
third of a loader thread's work on the H200 hosts where 16 threads are bound by what
memory passes (scripts/probe_chunks.py). On the GPU it reads device memory at terabytes
a second, behind the copies, and the host never waits for it until the load is done.

The rule is checkpoint/finite.py's: a value is NaN or infinite exactly when its bits
without the sign are at least the dtype's limit (nonfinite_limit). The reference is
all_finite there; the GPU test checks the kernel against it and against torch.
"""

from __future__ import annotations

import ctypes

from preload.checkpoint.finite import nonfinite_limit
from preload.ipc import nvrtc

KERNEL = "find_nonfinite"
SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) find_nonfinite(
    const unsigned char* __restrict__ data, long long n, int width, unsigned limit, unsigned* first, unsigned tag)
{
    // n values of `width` bytes (1, 2 or 4) at data; `first` takes `tag` if it holds 0 and
    // any value here has its bits without the sign >= limit.
    bool bad = false;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned bits;
        if (width == 2) bits = ((const unsigned short*)data)[i] & 0x7FFFu;
        else if (width == 4) bits = ((const unsigned*)data)[i] & 0x7FFFFFFFu;
        else bits = data[i] & 0x7Fu;
        bad |= bits >= limit;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicCAS(first, 0u, tag);
}
"""
THREADS, MAX_BLOCKS = 256, 1024  # (a grid-stride loop: a large tensor takes the whole GPU, a small one a block)


def checkable(dtype: str) -> bool:
    """Whether the kernel checks values of `dtype` (float64 is left to the host; integers
    need no check)."""
    limit = nonfinite_limit(dtype)
    return limit is not None and limit[0] in (1, 2, 4)


INSTEAD = "NaN/Inf checked on the host, not on the GPU"


def available(ordinal: int) -> bool:
    """Whether GPU `ordinal` can check here (the kernel compiles for it; once per process)."""
    return nvrtc.compiles(SOURCE, KERNEL, ordinal, INSTEAD)


class FiniteCheck(nvrtc.Kernel):
    def __init__(self, ordinal: int):
        super().__init__(SOURCE, KERNEL, ordinal, INSTEAD)

    def launch(self, stream: ctypes.c_void_p | int, address: int, nbytes: int, dtype: str, first: int, tag: int) -> None:
        """Check the `nbytes` of `dtype` values at device address `address` in `stream`'s
        order: the 32-bit device word at `first` takes `tag` (non-zero) if it is 0 and
        some value is NaN or infinite."""
        width, limit = nonfinite_limit(dtype)
        n = nbytes // width
        if n == 0:
            return
        blocks = min(MAX_BLOCKS, -(-n // THREADS))
        self.run(stream, (blocks, 1), THREADS, ctypes.c_uint64(address), ctypes.c_longlong(n), ctypes.c_int(width),
                 ctypes.c_uint32(limit), ctypes.c_uint64(first), ctypes.c_uint32(tag))
