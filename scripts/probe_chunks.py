"""What a loader thread's pass over a chunk costs, with every core at it: BLAKE3, the
finiteness check (the old AND-then-max and checkpoint/finite.py's two max reductions),
and the three fused as copy_loader runs them (hash, check, copy into a buffer of the
thread's), with the check and copy per chunk of 8 MiB or per smaller piece of it while the
piece is still in the core's cache. On one checkpoint's files, page cache warm.

On the H200 host (16 threads, V2-Lite, results/probes/probe-chunks-m2-h200.json) each pass alone runs
at 57-72 GB/s and the three fused per 8 MiB at 22 GB/s; per 1 MiB or 256 KiB piece it is 3x
and 8x slower: the calls per piece, each taking the GIL, cost more than the cache saves.
Hence identity.CHUNK_BYTES.

    python3 scripts/probe_chunks.py DIR [THREADS]   (preload importable)
"""

import ctypes
import json
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from blake3 import blake3

from preload.checkpoint.finite import all_finite
from preload.checkpoint.pages import populate

CHUNK = 8 << 20


def and_max(data) -> bool:  # the check before checkpoint/finite.py's two max reductions (bf16)
    return int(np.bitwise_and(np.frombuffer(data, dtype=np.uint16), np.uint16(0x7FFF)).max()) < 0x7F80


def main(model_dir: Path, threads: int) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    maps = []
    for f in files:
        with open(f, "rb") as fh:
            maps.append(mmap.mmap(fh.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ))
    pieces = [(m, at, min(CHUNK, len(m) - at) // 2 * 2) for m in maps for at in range(0, len(m), CHUNK)]
    total = sum(n for _, _, n in pieces)
    for m in maps:
        populate(np.frombuffer(m, dtype=np.uint8).ctypes.data, len(m))
    local = threading.local()

    def buffer() -> np.ndarray:
        if not hasattr(local, "buf"):
            local.buf = np.empty(CHUNK, dtype=np.uint8)
        return local.buf

    def fused(piece: int):
        def run(p) -> None:
            m, at, n = p
            h, dst = blake3(max_threads=1), buffer().ctypes.data
            with memoryview(m) as whole:
                chunk = whole[at : at + n]
                for off in range(0, n, piece):
                    part = chunk[off : off + piece]
                    h.update(part)
                    all_finite("bfloat16", part)
                    ctypes.memmove(dst + off, np.frombuffer(part, dtype=np.uint8).ctypes.data, len(part))
                del chunk, part
        return run

    def each(fn):
        def run(p) -> None:
            m, at, n = p
            with memoryview(m) as whole:
                chunk = whole[at : at + n]
                fn(chunk)
                del chunk
        return run

    variants = {
        "blake3": each(lambda c: blake3(c, max_threads=1).digest()),
        "finite: AND then max (before)": each(and_max),
        "finite: two max (finite.py)": each(lambda c: all_finite("bfloat16", c)),
        "memmove into a buffer": each(lambda c: ctypes.memmove(buffer().ctypes.data, np.frombuffer(c, dtype=np.uint8).ctypes.data, len(c))),
        "hash+check+copy per 8 MiB": fused(8 << 20),
        "hash+check+copy per 1 MiB": fused(1 << 20),
        "hash+check+copy per 256 KiB": fused(256 << 10),
    }
    results = {"bytes": total, "threads": threads, "cpus": os.cpu_count(), "numpy": np.__version__}
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(variants["memmove into a buffer"], pieces[: threads * 4]))  # (the buffers allocated)
        for name, fn in variants.items():
            t = time.perf_counter()
            list(pool.map(fn, pieces))
            s = time.perf_counter() - t
            results[name] = round(s, 3)
            print(f"{name:36s} {s:7.3f} s  {total / s / 1e9:6.1f} GB/s", flush=True)
    for m in maps:
        m.close()
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe-chunks.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else (os.cpu_count() or 8))
