"""Arenas: one fd-backed region per device holding every tensor, packed at aligned offsets.

The daemon creates an arena, writes each tensor once, seals it and hands it out;
workers map it read-only and build tensor views, without copying. The manifest's
entries (name, dtype, shape, offset, nbytes) say where each tensor lives.

Transports: `memfd` (host memory, sealed against writes, growth and shrinking), and
the CUDA transports `cuda-vmm` and `cuda-ipc` (ipc/cuda.py) with the same two sides.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vector loads
MEMFD_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TRANSPORTS = ("memfd", "cuda-vmm", "cuda-ipc")


class ArenaError(RuntimeError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> dict:
        return asdict(self) | {"shape": list(self.shape)}

    @classmethod
    def from_wire(cls, d: dict) -> TensorEntry:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArenaError(f"unknown dtype {name!r}")
    return dtype


def pack(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[TensorEntry], int]:
    """Lay tensors out back to back at ALIGN-byte offsets; returns entries and total size."""
    entries, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        entries.append(TensorEntry(name, str(dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def tensor_views(base: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Typed views into a flat uint8 tensor that holds an arena."""
    return {
        e.name: base[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape) for e in entries
    }


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

    def write(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        check_planned(entry, tensor)
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy()
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], entry.offset + done)

    def seal(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)

    def info(self) -> dict:
        """What goes into the manifest; the fd itself travels over SCM_RIGHTS."""
        return {"transport": self.transport, "size": self.size}

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_planned(entry: TensorEntry, tensor: torch.Tensor) -> None:
    if str(tensor.dtype).removeprefix("torch.") != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise ArenaError(f"tensor {entry.name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {entry.dtype} {entry.shape}")


def default_transport(device: torch.device) -> str:
    return "cuda-vmm" if device.type == "cuda" else "memfd"


def create_arena(transport: str, size: int, device: torch.device):
    """The daemon side of an arena: write(entry, tensor), seal(), info(), fds(), close()."""
    if transport not in TRANSPORTS:
        raise ArenaError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if (transport == "memfd") != (device.type == "cpu"):
        raise ArenaError(f"transport {transport} cannot hold weights on {device}")
    if transport == "memfd":
        return MemfdArena(size)
    from preload.ipc.cuda import IpcArena, VmmArena

    return (VmmArena if transport == "cuda-vmm" else IpcArena)(size, device)


def map_arena(info: dict, fds: list[int]):
    """The worker side: an object whose `base` is the arena as a flat uint8 tensor."""
    transport = info.get("transport")
    if transport == "memfd":
        return MappedArena(info, fds)
    if transport in ("cuda-vmm", "cuda-ipc"):
        from preload.ipc.cuda import IpcMapping, VmmMapping

        return (VmmMapping if transport == "cuda-vmm" else IpcMapping)(info, fds)
    for fd in fds:
        os.close(fd)
    raise ArenaError(f"unknown arena transport {transport!r}")


class MappedArena:
    """Worker side: the arena mapped read-only, as one flat uint8 tensor."""

    def __init__(self, handle: dict, fds: list[int]):
        if handle.get("transport") != "memfd" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ArenaError(f"cannot map arena {handle!r} with {len(fds)} fds")
        self.size = int(handle["size"])
        self.fd = fds[0]
        try:
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
            if seals & MEMFD_SEALS != MEMFD_SEALS:
                raise ArenaError("arena memfd is not sealed; refusing to trust it")
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
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
