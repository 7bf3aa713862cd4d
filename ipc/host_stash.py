"""A cuda-vmm arena's bytes kept in host memory while its device memory is freed, and put
back into a new allocation: the daemon's sleep level 1 on a GPU (preloadd/sleeping.py).

The daemon holds a sealed arena only as its exported fd (its own mapping goes at seal; a
re-adopted arena was never mapped here), so the bytes are read through a read-only import
of that fd. The host copy is a memfd (host memory, as vLLM's level 1 keeps it), page-locked
for the copies (cuMemHostRegister: the copy engines then move it at the bus's speed, ~45
GiB/s on an H100 host, rather than through the driver's staging buffers at ~6). It is
copied a chunk at a time: threads fault the next chunks' pages in (zeroed by the kernel:
the slow part) while a chunk is registered and copied. On an H100 host, V2-Lite's 29 GiB:
6.3 s, against 11.2 s with one registration of the whole faulting them in, and 0.6 s back
either way (scripts/probe_host_stash.py). What comes back is the same bytes in a new
allocation on the same device: the manifest's layout and fingerprint stand, only its
arena's handle is new. Driver API only: the daemon never needs torch for this.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from preload.ipc.cuda import CU_MEM_ACCESS_FLAGS_PROT_READ, VmmArena, _check, _import, _map, _unmap
from preload.ipc.devices import driver as _cu
from preload.ipc.devices import make_current
from preload.ipc.layout import ArenaError
from preload.ipc.manifest import ArenaInfo

CU_MEMHOSTREGISTER_PORTABLE = 1  # (any context may copy from it)
MADV_POPULATE_WRITE = 23  # (Linux 5.14: fault a range's pages in, writable, without touching them from Python)
CHUNK = 1 << 30  # bytes registered and copied at a time
POPULATE_THREADS = 8  # faulting chunks in ahead of the copies (8 on the H100 host: 4.6 GiB/s in all)


@dataclass
class HostStash:
    """An arena's bytes in host memory (a memfd, mapped here), page-locked while held
    (chunk by chunk: `registered` holds the chunks' offsets)."""

    info: ArenaInfo
    fd: int
    map: mmap.mmap
    address: int  # of the mapping, for the driver
    registered: list[int] = field(default_factory=list)
    unpinned: str | None = None  # why a chunk stayed pageable (then its copies go through the driver's staging)

    @property
    def pinned(self) -> bool:
        return bool(self.registered) and self.unpinned is None

    def chunks(self) -> list[tuple[int, int]]:
        return [(at, min(CHUNK, self.info.size - at)) for at in range(0, self.info.size, CHUNK)]

    def pin(self, at: int, n: int) -> None:
        """Page-lock the chunk at `at` (pageable it still works, slower: `unpinned` says why)."""
        rc = _cu().cuMemHostRegister_v2(ctypes.c_void_p(self.address + at), ctypes.c_size_t(n),
                                        CU_MEMHOSTREGISTER_PORTABLE)
        if rc == 0:
            self.registered.append(at)
        elif self.unpinned is None:
            self.unpinned = f"cuMemHostRegister of {n} bytes at +{at}: CUDA error {rc}"

    def close(self) -> None:
        if self.registered:
            make_current(self.info.device)
            for at in self.registered:
                _cu().cuMemHostUnregister(ctypes.c_void_p(self.address + at))
            self.registered = []
        self.map.close()
        os.close(self.fd)


_libc = ctypes.CDLL(None)


def _populate(address: int, n: int) -> None:
    """Fault in [address, address + n) (ctypes lets go of the GIL meanwhile); where the
    kernel lacks MADV_POPULATE_WRITE, registering the chunk faults its pages in instead."""
    _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(n), MADV_POPULATE_WRITE)


def host_room() -> int:
    """Bytes this process can still take in host memory: the kernel's MemAvailable, or less
    where its cgroup (v2) caps it. (A stash larger than this would not fail: the OOM killer
    would pick a process, the daemon likeliest.)"""
    import psutil

    room = psutil.virtual_memory().available
    try:
        cap = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cap != "max":
            room = min(room, int(cap) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return room


def stash(info: ArenaInfo, fd: int) -> HostStash:
    """The bytes of the cuda-vmm arena exported as `fd`, copied into host memory."""
    if info.transport != "cuda-vmm":
        raise ArenaError(f"a {info.transport} arena is not moved to host memory")
    host = os.memfd_create("preload-stash", os.MFD_CLOEXEC)
    try:
        os.ftruncate(host, info.size)
        mapped = mmap.mmap(host, info.size)
    except BaseException:
        os.close(host)
        raise
    held = HostStash(info, host, mapped, np.frombuffer(mapped, dtype=np.uint8).ctypes.data)
    try:
        make_current(info.device)
        cu, handle = _cu(), _import(fd)
        try:
            ptr = _map(handle, info.size, info.device, CU_MEM_ACCESS_FLAGS_PROT_READ)
            try:
                chunks = held.chunks()
                with ThreadPoolExecutor(POPULATE_THREADS, thread_name_prefix="stash-populate") as pool:
                    faulted = [pool.submit(_populate, held.address + at, n) for at, n in chunks]
                    for (at, n), done in zip(chunks, faulted):
                        done.result()
                        held.pin(at, n)
                        _check(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(held.address + at), ctypes.c_uint64(ptr + at),
                                                  ctypes.c_size_t(n)), "cuMemcpyDtoH")
            finally:
                _unmap(ptr, info.size)
        finally:
            cu.cuMemRelease(ctypes.c_uint64(handle))
    except BaseException:
        held.close()
        raise
    return held


def restore(held: HostStash) -> VmmArena:
    """A new cuda-vmm arena on the stash's device holding its bytes, sealed."""
    arena = VmmArena(held.info.size, f"cuda:{held.info.device}")
    try:
        if arena.size != held.info.size:  # (the same device's granularity: never, unless the driver changed)
            raise ArenaError(f"the new arena has {arena.size} bytes, the stash {held.info.size}")
        for at, n in held.chunks():  # (a chunk at a time: one copy never spans two registrations)
            _check(_cu().cuMemcpyHtoD_v2(ctypes.c_uint64(arena.ptr + at), ctypes.c_void_p(held.address + at),
                                         ctypes.c_size_t(n)), "cuMemcpyHtoD")
        arena.seal()
    except BaseException:
        arena.close()
        raise
    return arena
