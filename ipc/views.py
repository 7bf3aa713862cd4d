"""An arena's tensors as views: a worker's read-only map of the region (ipc/arena.py)
turned into one typed tensor per layout entry (ipc/layout.py), after checking every entry.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from preload.ipc.layout import ArenaError, Layout, TensorEntry


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArenaError(f"unknown dtype {name!r}")
    return dtype


def _int_column(values: list, what: str) -> np.ndarray:
    a = np.asarray(values) if values else np.zeros(0, dtype=np.int64)
    if a.ndim != 1 or a.dtype.kind != "i":  # strings, floats, bools or ints beyond int64
        raise ArenaError(f"manifest layout: the {what} are not all integers")
    return a.astype(np.int64, copy=False)


def _contiguous(shape: tuple, limit: int) -> tuple[int, tuple[int, ...]]:
    """numel and row-major strides of a shape of at most `limit` elements."""
    numel, strides = 1, []
    for n in reversed(shape):
        if type(n) is not int or n < 0:
            raise ArenaError(f"manifest layout: bad shape {shape!r}")
        strides.append(numel)
        numel *= n
    if numel > limit:  # also keeps numel * itemsize within int64 below
        raise ArenaError(f"manifest layout: shape {shape!r} is larger than the arena")
    return numel, tuple(reversed(strides))


def tensor_views(base: torch.Tensor, layout: Layout | Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Typed views into a flat uint8 tensor that holds an arena. The layout comes from
    another process: entries must lie inside `base`, not overlap, be aligned for their
    dtype, match their shapes and have distinct names, or nothing is viewed.

    Checked on whole columns at once, and viewed with one `as_strided` per tensor on a
    per-dtype view of the whole arena: a MoE model has thousands of tensors, and Python
    work per entry is most of what a restarting worker's attach costs."""
    if not isinstance(layout, Layout):
        layout = Layout.of(layout)
    size = base.numel()
    if not all(type(n) is str for n in layout.name) or len(set(layout.name)) != len(layout.name):
        raise ArenaError("manifest layout: tensor names must be distinct strings")
    if not all(type(d) is str for d in layout.dtype):
        raise ArenaError("manifest layout: dtypes must be strings")
    itemsize = {d: torch_dtype(d).itemsize for d in set(layout.dtype)}
    try:  # MoE layers repeat a handful of shapes thousands of times: work each out once
        shapes = {s: _contiguous(s, size) for s in set(layout.shape)}
    except TypeError:
        raise ArenaError("manifest layout: bad shape") from None
    offset, nbytes = _int_column(layout.offset, "offsets"), _int_column(layout.nbytes, "sizes")
    item = np.array([itemsize[d] for d in layout.dtype], dtype=np.int64)
    numel = np.array([shapes[s][0] for s in layout.shape], dtype=np.int64)
    end = offset + nbytes  # can wrap only where offset or nbytes is far out of range: refused below
    order = np.argsort(offset, kind="stable")
    overlaps = np.zeros(len(order), dtype=bool)
    overlaps[order[1:]] = offset[order[1:]] < end[order[:-1]]
    problems = {
        "lies outside the arena": (offset < 0) | (offset > size) | (end > size),
        "is misaligned for its dtype": offset % item != 0,
        "does not match its shape's size": nbytes != numel * item,
        "overlaps another": overlaps,
    }
    for what, bad in problems.items():
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            raise ArenaError(
                f"manifest entry {layout.name[e]} ({layout.dtype[e]} {layout.shape[e]}, {layout.nbytes[e]} bytes"
                f" at offset {layout.offset[e]}) {what}"
            )
    typed = {d: base[: size - size % n].view(torch_dtype(d)) for d, n in itemsize.items()}
    first = {d: t.storage_offset() for d, t in typed.items()}  # as_strided offsets are absolute
    return {
        name: typed[d].as_strided(s, shapes[s][1], first[d] + o // itemsize[d])
        for name, d, s, o in zip(layout.name, layout.dtype, layout.shape, layout.offset)
    }
