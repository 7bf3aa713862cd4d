"""Where each tensor lives in an arena: entries packed at aligned offsets and carried in
the manifest as columns (ipc/views.py turns them back into tensor views, checking each).

An arena is one flat byte region per device (ipc/arena.py makes them); this module is
the part both sides share: the daemon packs a layout and writes tensors at its
offsets, a worker views the same offsets in its read-only map of the region.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from preload.checkpoint.headers import DTYPE_BYTES, TORCH_NAMES

if TYPE_CHECKING:  # (no torch, no numpy: the daemon reads and hands on layouts without them; ipc/views.py views them)
    import torch

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vector loads


class ArenaError(RuntimeError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


ITEMSIZE = {TORCH_NAMES[code]: size for code, size in DTYPE_BYTES.items()}  # by torch dtype name


def pack(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[list[TensorEntry], int]:
    """Lay tensors (name, torch dtype name, shape) out back to back at ALIGN-byte offsets;
    returns entries and total size."""
    entries, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = ITEMSIZE[dtype] * math.prod(shape)
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


@dataclass(frozen=True)
class Layout:
    """An arena's entries column by column (TensorEntry's fields), as the manifest
    carries them. A MoE model has thousands of tensors: five lists encode and decode
    (msgpack) several times faster than as many maps, and checks run on whole columns."""

    name: list[str]
    dtype: list[str]
    shape: list[tuple[int, ...]]
    offset: list[int]
    nbytes: list[int]

    @classmethod
    def of(cls, entries: Iterable[TensorEntry]) -> Layout:
        entries = list(entries)
        return cls(*([getattr(e, f.name) for e in entries] for f in fields(cls)))

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # msgpack sends tuples as arrays

    @classmethod
    def from_wire(cls, d: dict) -> Layout:
        """Only the columns' form is checked here; views.tensor_views checks what they say."""
        columns = [d.get(f.name) for f in fields(cls)] if isinstance(d, dict) else [None]
        if not all(isinstance(c, list) and len(c) == len(columns[0]) for c in columns):
            names = ", ".join(f.name for f in fields(cls))
            raise ArenaError(f"malformed manifest layout: expected equally long lists {names}")
        name, dtype, shape, offset, nbytes = columns
        if not all(isinstance(s, list) for s in shape):
            raise ArenaError("malformed manifest layout: a shape is not a list")
        return cls(name, dtype, [tuple(s) for s in shape], offset, nbytes)


def check_planned(entry: TensorEntry, tensor: torch.Tensor) -> None:
    if str(tensor.dtype).removeprefix("torch.") != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise ArenaError(f"tensor {entry.name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {entry.dtype} {entry.shape}")


def check_part(entry: TensorEntry, at: int, n: int) -> None:
    if at < 0 or at + n > entry.nbytes:
        raise ArenaError(f"tensor {entry.name}: bytes [{at}, {at + n}) lie outside its {entry.nbytes}")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's bytes, flat (a device tensor is copied to the host first)."""
    import torch

    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
