"""A worker's KV cache memory, made so that it can outlive the worker.

Freeing and allocating 90 GB of device memory costs what restarting a worker should
not: the driver clears memory another process let go of before it hands it out again
(0.12 s for a new worker's cache on an H200, after a kill), while mapping an allocation
that still exists takes 2.5 ms. So a supervised worker makes its KV cache as one
shareable allocation (CUDA VMM, exported as a file descriptor; a memfd on the CPU) and
gives the fd to its daemon, which holds it for the worker's slot. The slot's next
worker (a spare taking over, a fork, a rolling restart) maps the same memory instead
of allocating: what the last worker left in it is stale but finite, and a cache never
reads a slot it has not written, except the blocks its ledger names
(worker/engine/block_ledger.py): those the last worker finished, taken up as cached.

Only processes of the daemon's uid get it: its workers, over their links.
"""

from __future__ import annotations

import mmap
import os

import torch

from preload.ipc.manifest import ArenaInfo


class KvMemory:
    """One flat uint8 tensor (`tensor`) of `size` bytes, and the fd that maps it in
    another process (`fd`, owned by this object). `fresh`: made now, zeroed."""

    def __init__(self, tensor: torch.Tensor, fd: int, holder=None, fresh: bool = False):
        self.tensor, self.fd, self._holder, self.fresh = tensor, fd, holder, fresh
        self.size = tensor.numel()

    @classmethod
    def create(cls, size: int, device: torch.device) -> KvMemory:
        """New memory of at least `size` bytes (CUDA: whole allocation granules), zeroed."""
        if device.type == "cuda":
            from preload.ipc.cuda import VmmArena

            arena = VmmArena(size, str(device))
            base = arena.as_tensor()
            base.zero_()
            return cls(base, os.dup(arena.fd), arena, fresh=True)
        fd = os.memfd_create("preload-kv", os.MFD_CLOEXEC)  # zero-filled, like any new file
        try:
            os.ftruncate(fd, size)
            return cls._map_host(fd, size, fresh=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int, device: torch.device) -> KvMemory:
        """The memory behind `fd` (which this object now owns), `size` bytes, writable."""
        try:
            if device.type == "cuda":
                from preload.ipc.cuda import VmmMapping

                mapping = VmmMapping(ArenaInfo("cuda-vmm", size, device.index or 0), [os.dup(fd)], writable=True)
                return cls(mapping.base[:size], fd, mapping)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"KV memory of {os.fstat(fd).st_size} bytes offered, {size} needed")
            return cls._map_host(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _map_host(cls, fd: int, size: int, fresh: bool = False) -> KvMemory:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(torch.frombuffer(mm, dtype=torch.uint8), fd, mm, fresh)

    def close(self) -> None:
        """Unmap (VMM; a host mapping goes with the last tensor that views it) and close the fd."""
        self.tensor = None
        if self._holder is not None and not isinstance(self._holder, mmap.mmap):
            self._holder.close()
        self._holder = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
