"""Host-memory arenas: an anonymous memfd, written once, sealed, mapped read-only.

The seals (no writes, no growing or shrinking, no new seals) bind every process, the
daemon included; a worker refuses a memfd that is not sealed. A private copy-on-write
map is still possible, but its writes stay in the process that made them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import warnings
from typing import TYPE_CHECKING

from preload.ipc.layout import ArenaError, TensorEntry, check_part, check_planned, tensor_bytes
from preload.ipc.manifest import ArenaInfo

if TYPE_CHECKING:  # (imported where tensors are: a daemon that loads without arithmetic never does)
    import torch

ALLOCATE_CHUNK = 64 << 20
MEMFD_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MemfdArena:
    """Daemon side of a host-memory arena: an anonymous memfd, written with pwrite,
    then sealed so that no process (the daemon included) can change or resize it."""

    transport = "memfd"

    def __init__(self, size: int, label: str = "preload-arena"):
        self.size = size
        self.fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        # Allocating the memfd's pages (the kernel zeroes each) is about half of writing
        # them: done ahead, in order, by a thread of its own, it overlaps with the reads
        # and hashes of the tensors before; a write that gets there first allocates its pages.
        self._stop = threading.Event()
        self._allocating = threading.Thread(target=self._allocate, name="arena-allocate", daemon=True)
        self._allocating.start()

    def _allocate(self) -> None:
        for at in range(0, self.size, ALLOCATE_CHUNK):
            if self._stop.is_set():
                return
            try:
                os.posix_fallocate(self.fd, at, min(ALLOCATE_CHUNK, self.size - at))
            except OSError:
                return  # out of memory: the writes will say so

    def write(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        check_planned(entry, tensor)
        self.write_part(entry, 0, tensor_bytes(tensor))

    def write_part(self, entry: TensorEntry, at: int, data: memoryview) -> None:
        """Bytes of `entry` from byte `at` on: a chunk of the tensor, written while the
        loader's pass over it (hash, check) still has it in the cache."""
        check_part(entry, at, len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], entry.offset + at + done)

    def seal(self) -> None:
        self._allocating.join()
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)

    def info(self) -> ArenaInfo:
        """What goes into the manifest; the fd itself travels over SCM_RIGHTS."""
        return ArenaInfo(self.transport, self.size)

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        self._stop.set()
        self._allocating.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1




class MappedArena:
    """Worker side: the arena mapped read-only, as one flat uint8 tensor."""

    def __init__(self, info: ArenaInfo, fds: list[int]):
        if info.transport != "memfd" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ArenaError(f"cannot map arena {info!r} with {len(fds)} fds")
        self.size = info.size
        self.fd = fds[0]
        try:
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
            if seals & MEMFD_SEALS != MEMFD_SEALS:
                raise ArenaError("arena memfd is not sealed; refusing to trust it")
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        import torch

        with warnings.catch_warnings():
            # The buffer is read-only on purpose: a write faults instead of touching the weights.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.base = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        # Views may outlive us; the mapping goes away when the last one is freed.
        self.base = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
