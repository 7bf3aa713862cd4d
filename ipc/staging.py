"""Copies from host memory to a GPU through pinned buffers of our own, without torch.

A copy from pageable memory (the file's mapping) goes through the driver's own staging,
which on the H200 host moved 6.9 GB/s however many threads asked (scripts/probe_load.py,
results/probe-load-h200.json), as slow as `cat`. Here each loader thread has two pinned
buffers and a stream: a chunk is copied into one buffer (memmove, the GIL released) and
sent from there while the thread hashes the next chunk; a buffer is refilled only once
the copy out of it is done (an event). The copies of all threads run at once.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from preload.ipc.devices import driver as _cu
from preload.ipc.devices import make_current

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
        for buf, event in zip(self.buffers, self.events):
            cu.cuEventDestroy_v2(event)
            cu.cuMemFreeHost(buf)
        cu.cuStreamDestroy_v2(self.stream)
        self.buffers, self.events = [], []


class Staging:
    """Staged copies to GPU `ordinal` from any number of threads (each gets its own
    buffers on first use). `finish()` waits for every copy and frees the buffers."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self._local = threading.local()
        self._all: list[_ThreadStaging] = []
        self._lock = threading.Lock()

    def send(self, dst: int, data: memoryview) -> None:
        mine = getattr(self._local, "staging", None)
        if mine is None:
            mine = self._local.staging = _ThreadStaging(self.ordinal)
            with self._lock:
                self._all.append(mine)
        make_current(self.ordinal)
        src = np.frombuffer(data, dtype=np.uint8).ctypes.data  # (a read-only mapping has an address too)
        mine.send(dst, src, len(data))

    def finish(self) -> None:
        make_current(self.ordinal)
        with self._lock:
            stagings, self._all = self._all, []
        for s in stagings:
            s.close()
        self._local = threading.local()
