"""Copies from host memory to a GPU through pinned buffers of our own, without torch.

A copy from pageable memory (the file's mapping) goes through the driver's own staging,
which on the H200 host moved 6.9 GB/s however many threads asked (scripts/probe_load.py,
results/probes/probe-load-h200.json), as slow as `cat`. Here each loader thread has two pinned
buffers and a stream: a chunk is copied into one buffer (memmove, the GIL released) and
sent from there while the thread hashes the next chunk; a buffer is refilled only once
the copy out of it is done (an event). The copies of all threads run at once. A tensor
to be quantized goes to a device scratch of the thread's, which the quantization kernel
reads in the same stream, so that the next tensor's copies wait for it, and nothing else.
The NaN/Inf check (ipc/finite_device.py) runs in the same stream too, behind a tensor's
copies; each thread has a device word that keeps the tag of the first bad tensor it sent.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from preload.ipc.devices import driver as _cu
from preload.ipc.devices import make_current
from preload.ipc.finite_device import FiniteCheck
from preload.ipc.fp8_device import Fp8BlockQuantizer

BUFFER_BYTES = 8 << 20  # one hashed chunk (checkpoint/identity.py CHUNK_BYTES)
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: CUDA error {result}")


class _ThreadStaging:
    """One thread's two pinned buffers, its stream and an event per buffer."""

    def __init__(self, ordinal: int):
        cu = _cu()
        make_current(ordinal)
        self.buffers, self.events, self.turn = [], [], 0
        self.stream = ctypes.c_void_p()
        _check(cu.cuStreamCreate(ctypes.byref(self.stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        for _ in range(2):
            buf, event = ctypes.c_void_p(), ctypes.c_void_p()
            _check(cu.cuMemHostAlloc(ctypes.byref(buf), ctypes.c_size_t(BUFFER_BYTES), 0), "cuMemHostAlloc")
            self.buffers.append(buf)
            _check(cu.cuEventCreate(ctypes.byref(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            self.events.append(event)
        self.recorded = [False, False]
        self.scratch, self.scratch_bytes = 0, 0  # device memory a tensor is staged in (Staging.stage)
        self.first = 0  # a device word: the tag of this thread's first tensor found NaN or Inf (0: none)

    def first_word(self) -> int:
        if not self.first:
            cu, ptr = _cu(), ctypes.c_uint64()
            _check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4)), "cuMemAlloc")
            self.first = ptr.value
            _check(cu.cuMemsetD32_v2(ctypes.c_uint64(self.first), 0, ctypes.c_size_t(1)), "cuMemsetD32")
        return self.first

    def first_nonfinite(self) -> int:
        """The tag its device word holds, once its stream is done."""
        if not self.first:
            return 0
        cu, tag = _cu(), ctypes.c_uint32()
        _check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        _check(cu.cuMemcpyDtoH_v2(ctypes.byref(tag), ctypes.c_uint64(self.first), ctypes.c_size_t(4)), "cuMemcpyDtoH")
        return tag.value

    def scratch_for(self, nbytes: int) -> int:
        """This thread's device scratch of at least `nbytes` (a larger one once the stream
        is past every use of the old)."""
        if nbytes > self.scratch_bytes:
            cu, ptr = _cu(), ctypes.c_uint64()
            self._free_scratch()
            _check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            self.scratch, self.scratch_bytes = ptr.value, nbytes
        return self.scratch

    def _free_scratch(self) -> None:
        if self.scratch:
            cu = _cu()
            cu.cuStreamSynchronize(self.stream)
            cu.cuMemFree_v2(ctypes.c_uint64(self.scratch))
            self.scratch, self.scratch_bytes = 0, 0

    def send(self, dst: int, src: int, n: int) -> None:
        """n bytes at host address `src` to device address `dst`: `src` may be reused on return."""
        cu = _cu()
        for at in range(0, n, BUFFER_BYTES):
            size, i = min(BUFFER_BYTES, n - at), self.turn
            self.turn ^= 1
            if self.recorded[i]:
                _check(cu.cuEventSynchronize(self.events[i]), "cuEventSynchronize")  # its last copy is out
            ctypes.memmove(self.buffers[i], src + at, size)  # (releases the GIL)
            _check(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dst + at), self.buffers[i], ctypes.c_size_t(size), self.stream),
                   "cuMemcpyHtoDAsync")
            _check(cu.cuEventRecord(self.events[i], self.stream), "cuEventRecord")
            self.recorded[i] = True

    def close(self) -> None:
        cu = _cu()
        cu.cuStreamSynchronize(self.stream)
        self._free_scratch()
        if self.first:
            cu.cuMemFree_v2(ctypes.c_uint64(self.first))
            self.first = 0
        for buf, event in zip(self.buffers, self.events):
            cu.cuEventDestroy_v2(event)
            cu.cuMemFreeHost(buf)
        cu.cuStreamDestroy_v2(self.stream)
        self.buffers, self.events = [], []


class Staging:
    """Staged copies to GPU `ordinal` from any number of threads (each gets its own
    buffers on first use), straight to their place or, for a tensor to be quantized, to
    the thread's device scratch first (stage, then quantize_staged). `finish()` waits for
    every copy and kernel and frees the buffers. A check_finite queued after a tensor's
    copies reads what they wrote; first_nonfinite() says, once all are done, which
    tensor was found bad."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self._local = threading.local()
        self._all: list[_ThreadStaging] = []
        self._lock = threading.Lock()
        self._kernels: dict[type, Fp8BlockQuantizer | FiniteCheck] = {}  # (each loaded once per load)

    def _mine(self) -> _ThreadStaging:
        mine = getattr(self._local, "staging", None)
        if mine is None:
            mine = self._local.staging = _ThreadStaging(self.ordinal)
            with self._lock:
                self._all.append(mine)
        make_current(self.ordinal)
        return mine

    def send(self, dst: int, data: memoryview) -> None:
        self._mine().send(dst, _address(data), len(data))

    def stage(self, at: int, data: memoryview, total: int) -> None:
        """Bytes `at`.. of a tensor of `total` bytes into this thread's device scratch."""
        mine = self._mine()
        mine.send(mine.scratch_for(total) + at, _address(data), len(data))

    def _kernel(self, kind: type):
        with self._lock:
            if kind not in self._kernels:
                self._kernels[kind] = kind(self.ordinal)
            return self._kernels[kind]

    def quantize_staged(self, q: int, scale_inv: int, rows: int, cols: int) -> None:
        """The bf16 matrix [rows, cols] this thread staged, quantized to block FP8 at device
        addresses `q` and `scale_inv` (ipc/fp8_device.py), in the order of its copies."""
        mine = self._mine()
        self._kernel(Fp8BlockQuantizer).launch(mine.stream, mine.scratch, q, scale_inv, rows, cols)

    def check_finite(self, address: int, nbytes: int, dtype: str, tag: int) -> None:
        """The `dtype` values at device address `address` checked for NaN and Inf after
        this thread's copies so far; `tag` (non-zero) names them if they hold any."""
        mine = self._mine()
        self._kernel(FiniteCheck).launch(mine.stream, address, nbytes, dtype, mine.first_word(), tag)

    def check_staged_finite(self, nbytes: int, dtype: str, tag: int) -> None:
        """check_finite of what this thread staged (stage)."""
        self.check_finite(self._mine().scratch, nbytes, dtype, tag)

    def first_nonfinite(self) -> int:
        """The smallest tag of those checked and found NaN or Inf, once every thread's
        copies and kernels are done; 0 if none."""
        make_current(self.ordinal)
        with self._lock:
            stagings = list(self._all)
        return min((tag for tag in (s.first_nonfinite() for s in stagings) if tag), default=0)

    def finish(self) -> None:
        make_current(self.ordinal)
        with self._lock:
            stagings, self._all = self._all, []
            kernels, self._kernels = self._kernels, {}
        for s in stagings:
            s.close()
        for kernel in kernels.values():
            kernel.close()
        self._local = threading.local()


def _address(data: memoryview) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data  # (a read-only mapping has an address too)
