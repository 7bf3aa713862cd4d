"""The arena layout as a worker reads it: a manifest from another process is checked
before any view is built (inside the arena, no overlap, aligned, sized as its shape
says), and the views are the right bytes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from preload.ipc.layout import ArenaError, Layout, pack
from preload.ipc.views import tensor_views

SPECS = [("a", torch.float32, (3, 5)), ("b", torch.bfloat16, (7,)), ("c", torch.uint8, (2, 2, 3)), ("d", torch.float32, ())]


def arena() -> tuple[torch.Tensor, dict]:
    """A flat uint8 arena holding SPECS, and the layout's wire form."""
    entries, size = pack([(name, str(dtype).removeprefix("torch."), shape) for name, dtype, shape in SPECS])
    base = torch.zeros(size, dtype=torch.uint8)
    for e, (_, dtype, shape) in zip(entries, SPECS):
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).to(dtype).reshape(shape)
        base[e.offset : e.offset + e.nbytes] = t.reshape(-1).view(torch.uint8)
    return base, Layout.of(entries).to_wire()


def over_the_wire(table: dict) -> Layout:
    return Layout.from_wire(msgpack.unpackb(msgpack.packb(table)))


def test_views_are_the_stored_tensors():
    base, table = arena()
    views = tensor_views(base, over_the_wire(table))
    assert list(views) == [name for name, _, _ in SPECS]
    for name, dtype, shape in SPECS:
        expected = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).to(dtype).reshape(shape)
        assert views[name].dtype == dtype and views[name].shape == shape and torch.equal(views[name], expected)
        assert views[name].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # zero-copy


def changed(table: dict, i: int, **fields) -> dict:
    table = {k: list(v) for k, v in table.items()}
    for k, v in fields.items():
        table[k][i] = v
    return table


# pack lays SPECS out at a [0, 60), b [256, 270), c [512, 524), d [768, 772) of 1024 bytes.
@pytest.mark.parametrize(
    "i, fields, why",
    [
        (1, dict(offset=-256), "outside the arena"),
        (1, dict(offset=10**6), "outside the arena"),
        (1, dict(offset=2**62), "outside the arena"),  # far enough that offset + nbytes could wrap
        (2, dict(offset=1020), "outside the arena"),  # starts inside, ends past the end
        (1, dict(offset=4), "overlaps"),  # b inside a
        (2, dict(shape=[768], nbytes=768, offset=0), "overlaps"),  # c spans a and b
        (3, dict(offset=770), "misaligned"),  # float32 at 2 mod 4
        (0, dict(nbytes=64), "shape's size"),  # 3x5 float32 is 60 bytes
        (1, dict(nbytes=2**63 - 1), "shape's size"),  # offset + nbytes wraps around in int64
        (0, dict(shape=[3, -5]), "bad shape"),
        (0, dict(shape=[2**40, 2**40]), "larger than the arena"),
        (0, dict(shape=[3.0, 5]), "bad shape"),
        (0, dict(shape=[[3], 5]), "bad shape"),
        (1, dict(offset="256"), "not all integers"),
        (1, dict(offset=256.0), "not all integers"),
        (2, dict(name="b"), "distinct"),
        (2, dict(name=["c"]), "distinct"),
        (0, dict(dtype="no_such_dtype"), "unknown dtype"),
    ],
)
def test_a_bad_entry_is_refused(i, fields, why):
    base, table = arena()
    with pytest.raises(ArenaError, match=why):
        tensor_views(base, over_the_wire(changed(table, i, **fields)))


@pytest.mark.parametrize(
    "table",
    [
        None,
        [],
        {"name": ["a"], "dtype": ["float32"], "shape": [[1]], "offset": [0]},  # no nbytes
        {"name": ["a"], "dtype": ["float32"], "shape": [[1]], "offset": [0, 256], "nbytes": [4]},  # uneven columns
        {"name": ["a"], "dtype": ["float32"], "shape": [1], "offset": [0], "nbytes": [4]},  # a shape not a list
    ],
)
def test_a_malformed_layout_is_refused(table):
    with pytest.raises(ArenaError):
        Layout.from_wire(table)
