"""Four ways to fill a host arena (a memfd) with a file's bytes, page cache warm, against
`cat` of the file: pwrite after fallocate (ipc/memfd.py: the pages allocated, and zeroed, by
a thread of their own, ahead of the writes); pwrite into holes (a whole page written needs
no zeroing); a shared mapping of the memfd populated the same way (MADV_POPULATE_WRITE)
and written with memcpy, without pwrite's work per page; the mapping written with no
populate (a fault per page). Two writer threads, 8 MiB at a time.

    python3 scripts/probe_memfd_write.py FILE [RUNS]

On the 2-core CPU machine (V2-Lite-mini, 1.15 GB) all are within noise of each other:
4.9-8.6x `cat` one day (the first three; results/probes/probe-memfd-write-mini-cpu.json), 4.0-5.6x
another (all four; results/probes/probe-memfd-write-mini-cpu-2.json): the fresh pages are the cost,
not how they are written, nor their zeroing.
"""

import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from preload.checkpoint.pages import populate

MADV_POPULATE_WRITE = 23
CHUNK, ALLOCATE = 8 << 20, 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def fill(size: int, allocate, write) -> float:
    """Seconds to run `allocate(at, n)` over the arena in a thread of its own beside `write(at)` per chunk on two."""
    t = time.perf_counter()
    allocating = threading.Thread(target=lambda: [allocate(at, min(ALLOCATE, size - at)) for at in range(0, size, ALLOCATE)])
    allocating.start()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write, range(0, size, CHUNK)))
    allocating.join()
    return time.perf_counter() - t


def main(path: Path, runs: int) -> None:
    with open(path, "rb") as f:
        source = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    size, view = len(source), memoryview(source)
    src = np.frombuffer(source, dtype=np.uint8).ctypes.data
    populate(src, size)
    results: dict = {"bytes": size, "runs": []}
    for _ in range(runs):
        run = {}
        t = time.perf_counter()
        subprocess.run(f"cat {path} > /dev/null", shell=True, check=True)
        run["cat"] = time.perf_counter() - t
        for name, mapped, populated in (("pwrite after fallocate", False, True), ("pwrite into holes", False, False),
                                        ("memcpy, MADV_POPULATE_WRITE", True, True), ("memcpy, page faults", True, False)):
            fd = os.memfd_create("probe", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            if not mapped:
                run[name] = fill(size, (lambda at, n: os.posix_fallocate(fd, at, n)) if populated else (lambda at, n: None),
                                 lambda at: os.pwrite(fd, view[at : at + CHUNK], at))
            else:
                m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                base = np.frombuffer(m, dtype=np.uint8).ctypes.data
                advise = MADV_POPULATE_WRITE if populated else 0  # (0: MADV_NORMAL, nothing done)
                run[name] = fill(size, lambda at, n: _libc.madvise(ctypes.c_void_p(base + at), ctypes.c_size_t(n), advise),
                                 lambda at: ctypes.memmove(base + at, src + at, min(CHUNK, size - at)))
                m.close()
            os.close(fd)
        print("  ".join(f"{k} {v:.3f} s" for k, v in run.items()), flush=True)
        results["runs"].append({k: round(v, 3) for k, v in run.items()})
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe-memfd-write.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
