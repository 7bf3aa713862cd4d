"""Block FP8 quantization on the GPU without torch, for a load that quantizes
(preloadd/copy_loader.py): a CUDA kernel compiled at run time (ipc/nvrtc.py), so that
the weights are quantized as they arrive, on each loader thread's stream, with no
`import torch` to wait for.

The reference is kernels/fp8.py's quantize_block, as torch computes it on a GPU: per
128 x 128 block, scale_inv = max(amax, 1e-12) * (1/448) (torch divides a tensor by a
scalar as a multiplication by its reciprocal), then q = e4m3(clamp(w / scale_inv,
-448, 448)) rounded to nearest even. The GPU test compares the two byte for byte.
e4m3 conversion in hardware needs compute capability 8.9 (Ada, Hopper) or newer.
"""

from __future__ import annotations

import ctypes

from preload.ipc import nvrtc

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


INSTEAD = "fp8 quantized with torch, not by our kernel"


def available(ordinal: int) -> bool:
    """Whether GPU `ordinal` can quantize here: e4m3 in hardware, NVRTC found, and the
    kernel compiled for it (torch quantizes otherwise)."""
    return nvrtc.compiles(SOURCE, KERNEL, ordinal, INSTEAD, MIN_CAPABILITY)


class Fp8BlockQuantizer(nvrtc.Kernel):
    def __init__(self, ordinal: int):
        super().__init__(SOURCE, KERNEL, ordinal, INSTEAD)

    def launch(self, stream: ctypes.c_void_p | int, src: int, q: int, scale_inv: int, rows: int, cols: int) -> None:
        """Quantize the bf16 matrix [rows, cols] at device address `src` into e4m3 at `q`
        and float32 block scales [ceil(rows/128), ceil(cols/128)] at `scale_inv`, in
        `stream`'s order (`src` must stay as it is until the stream passes this point)."""
        grid = (-(-cols // 128), -(-rows // 128))
        self.run(stream, grid, 256, ctypes.c_uint64(src), ctypes.c_uint64(q), ctypes.c_uint64(scale_inv),
                 ctypes.c_longlong(rows), ctypes.c_longlong(cols))
