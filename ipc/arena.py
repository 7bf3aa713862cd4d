"""Arenas: one fd-backed region per device holding every tensor (ipc/layout.py says where).

The daemon creates an arena, writes each tensor once, seals it and hands it out;
workers map it read-only and build tensor views, without copying. Both sides have the
same shape whatever the transport:
- daemon side: `write(entry, tensor)`, `write_part(entry, at, bytes)` (no torch),
  `seal()`, `info()` (what the manifest carries), `fds()` (what travels over
  SCM_RIGHTS), `close()`, `size`;
- worker side: `base` (the arena as a flat uint8 tensor), `close()`.

Transports: `memfd` (host memory, ipc/memfd.py) and the CUDA transports `cuda-vmm` and
`cuda-ipc` (ipc/cuda.py), each imported when used. A daemon makes, fills and seals a
memfd or cuda-vmm arena without torch (a load with no arithmetic never imports it), and
one that takes its weights back from a keeper (HeldArena) maps nothing at all.
"""

from __future__ import annotations

import os

from preload.ipc.layout import ArenaError
from preload.ipc.manifest import ArenaInfo
from preload.options import TRANSPORTS


def default_transport(device: str) -> str:
    """For a device name ("cpu", "cuda", "cuda:N")."""
    return "cuda-vmm" if device.startswith("cuda") else "memfd"


def create_arena(transport: str, size: int, device: str):
    """The daemon side of an arena on `device` ("cpu", "cuda", "cuda:N"): write(entry,
    tensor), write_part(entry, at, bytes), seal(), info(), fds(), close()."""
    if transport not in TRANSPORTS:
        raise ArenaError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if (transport == "memfd") != (device == "cpu"):
        raise ArenaError(f"transport {transport} cannot hold weights on {device}")
    if transport == "memfd":
        from preload.ipc.memfd import MemfdArena

        return MemfdArena(size)
    from preload.ipc.cuda import IpcArena, VmmArena

    return (VmmArena if transport == "cuda-vmm" else IpcArena)(size, device)


def map_arena(info: ArenaInfo, fds: list[int]):
    """The worker side: an object whose `base` is the arena as a flat uint8 tensor."""
    transport = info.transport
    if transport == "memfd":
        from preload.ipc.memfd import MappedArena

        return MappedArena(info, fds)
    if transport in ("cuda-vmm", "cuda-ipc") and info.device is not None:
        from preload.ipc.cuda import IpcMapping, VmmMapping

        return (VmmMapping if transport == "cuda-vmm" else IpcMapping)(info, fds)
    for fd in fds:
        os.close(fd)
    raise ArenaError(f"cannot map arena {info!r}: unknown transport, or no device for a CUDA one")


class HeldArena:
    """The daemon side of an arena it did not create: one taken back from the keeper a
    crashed daemon left (preloadd/keeper.py). Sealed already, never mapped here: the
    daemon only hands its fds to workers, as it does a fresh one's."""

    def __init__(self, info: ArenaInfo, fds: list[int]):
        if info.transport not in ("memfd", "cuda-vmm") or len(fds) != 1:
            raise ArenaError(f"cannot hold arena {info!r} with {len(fds)} fds")
        self._info, self._fds, self.size = info, list(fds), info.size

    def info(self) -> ArenaInfo:
        return self._info

    def fds(self) -> list[int]:
        return self._fds

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
