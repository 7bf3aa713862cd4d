"""`preload start` reads the checkpoint into the page cache in the background before the
daemon's imports (cli/start.py read_ahead, checkpoint/pages.py): files dropped from the
cache are back in it, whole."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
from daemons import wait_for

from preload.bench.file_reads import evict_from_page_cache
from preload.cli.start import read_ahead

_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(path) -> float:
    """Of the file's pages, the fraction in the page cache (mincore over a mapping)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)  # (its address; nothing is read)
        assert _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        del view
    return sum(v & 1 for v in vec) / pages


def test_read_ahead_brings_a_dropped_checkpoint_back_into_the_page_cache(tiny_checkpoint):
    [path] = list(tiny_checkpoint.glob("*.safetensors"))
    evict_from_page_cache([path])
    before = resident_fraction(path)
    read_ahead(tiny_checkpoint)
    assert wait_for(lambda: not any(t.name == "read-ahead" and t.is_alive() for t in threading.enumerate()), 10)
    assert wait_for(lambda: resident_fraction(path) > max(0.9, before), 10), (before, resident_fraction(path))
