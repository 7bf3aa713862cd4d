"""Where a cold load's time can go, piece by piece, on one checkpoint's files (page cache
warm): `cat`; mapping the pages in (MADV_POPULATE_READ) from one thread and from many;
BLAKE3 over the mapped bytes; the bf16 finiteness check; writing a host-memory arena (a
memfd: its pages allocated, then written, as preloadd/copy_loader.py does, and the sum of
those passes, the floor of a hashed, checked private copy); and on a GPU the copy to the
device from the file's mapping (pageable, on the default stream or a stream per thread)
and from the same mapping registered with the driver (pinned in place, no staging copy).

    python3 scripts/probe_load.py DIR [THREADS]   (preload importable; the GPU parts need CUDA)

Figures from the H200 are in results/probes/probe-load-h200.json, from the 2-core CPU machine in
results/probes/probe-load-mini-cpu.json.
"""

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
from blake3 import blake3

from preload.checkpoint.finite import all_finite
from preload.checkpoint.identity import CHUNK_BYTES
from preload.checkpoint.pages import populate

CHUNK = 64 << 20


def timed(what: str, results: dict, fn) -> None:
    t = time.perf_counter()
    fn()
    results[what] = round(time.perf_counter() - t, 3)
    print(f"{what:50s} {results[what]:8.3f} s", flush=True)


def ranges(maps: list[mmap.mmap]) -> list[tuple[int, int, int]]:
    """(mapping index, offset, length) pieces of CHUNK bytes over every file."""
    return [(i, at, min(CHUNK, len(m) - at)) for i, m in enumerate(maps) for at in range(0, len(m), CHUNK)]


def main(model_dir: Path, threads: int) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    results: dict = {"files": len(files), "bytes": total, "threads": threads, "cpus": os.cpu_count()}
    timed("cat", results, lambda: subprocess.run(f"cat {' '.join(map(str, files))} > /dev/null", shell=True, check=True))

    def mapped() -> list[mmap.mmap]:
        out = []
        for f in files:
            with open(f, "rb") as fh:
                out.append(mmap.mmap(fh.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ))
        return out

    maps = mapped()
    pieces = ranges(maps)
    timed("populate, 1 thread", results, lambda: [populate(_addr(maps[i]) + at, n) for i, at, n in pieces])
    for m in maps:
        m.close()
    maps = mapped()
    with ThreadPoolExecutor(threads + 1) as pool:
        timed(f"populate, {threads} threads", results, lambda: list(pool.map(lambda p: populate(_addr(maps[p[0]]) + p[1], p[2]), pieces)))
        timed(f"blake3, {threads} threads (pages mapped)", results,
              lambda: list(pool.map(lambda p: blake3(memoryview(maps[p[0]])[p[1]: p[1] + p[2]]).digest(), pieces)))

        def finite(p) -> bool:  # as the loader checks: CHUNK_BYTES at a time
            piece = memoryview(maps[p[0]])[p[1] - p[1] % 2: p[1] + p[2] - p[2] % 2]
            return all(all_finite("bfloat16", piece[at: at + CHUNK_BYTES]) for at in range(0, len(piece), CHUNK_BYTES))
        timed(f"bf16 finite (numpy), {threads} threads", results, lambda: list(pool.map(finite, pieces)))
        memfd(maps, pieces, pool, threads, results)
        for m in maps:
            m.close()
        maps = mapped()
        timed(f"populate+blake3, {threads} threads, fresh maps", results,
              lambda: list(pool.map(lambda p: (populate(_addr(maps[p[0]]) + p[1], p[2]),
                                               blake3(memoryview(maps[p[0]])[p[1]: p[1] + p[2]]).digest()), pieces)))
        for m in maps:
            m.close()
        maps = mapped()
        timed("import torch alone (a subprocess)", results, lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True))
        # The pre-pass a daemon could run while it imports torch: does the import slow it, or it the import?
        passed = pool.submit(lambda: list(pool.map(lambda p: (populate(_addr(maps[p[0]]) + p[1], p[2]),
                                                               blake3(memoryview(maps[p[0]])[p[1]: p[1] + p[2]]).digest(),
                                                               finite(p)), pieces)))
        t = time.perf_counter()
        timed("import torch here, with populate+blake3+finite running", results, lambda: __import__("torch"))
        passed.result()
        results["populate+blake3+finite beside the import"] = round(time.perf_counter() - t, 3)
        print("populate+blake3+finite beside the import", results["populate+blake3+finite beside the import"])
        import torch
        if torch.cuda.is_available():
            gpu(torch, maps, pieces, pool, threads, results)
    print(json.dumps(results))
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe-load.json").write_text(json.dumps(results, indent=2) + "\n")


def memfd(maps: list[mmap.mmap], pieces, pool, threads: int, results: dict) -> None:
    """The memfd arena's two passes: its pages allocated (fallocate, as MemfdArena's thread
    does ahead of the writes), then the bytes written (pwrite) from the files' mappings."""
    starts = [sum(len(m) for m in maps[:i]) for i in range(len(maps))]
    size = sum(len(m) for m in maps)
    fd = os.memfd_create("probe-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        timed("memfd: allocate every page (fallocate)", results, lambda: os.posix_fallocate(fd, 0, size))
        timed(f"memfd: pwrite, {threads} threads", results,
              lambda: list(pool.map(lambda p: os.pwrite(fd, memoryview(maps[p[0]])[p[1]: p[1] + p[2]], starts[p[0]] + p[1]),
                                    pieces)))
    finally:
        os.close(fd)
    passes = (f"blake3, {threads} threads (pages mapped)", f"bf16 finite (numpy), {threads} threads",
              "memfd: allocate every page (fallocate)", f"memfd: pwrite, {threads} threads")
    floor = results["host arena floor: the passes sum"] = round(sum(results[k] for k in passes), 3)
    print(f"{'host arena floor: the passes sum':50s} {floor:8.3f} s = {floor / results['cat']:.2f}x cat", flush=True)


_ADDR: dict[int, int] = {}


def _addr(m: mmap.mmap) -> int:
    """The mapping's address (a read-only mmap cannot lend ctypes a writable buffer: numpy reads it)."""
    if id(m) not in _ADDR:
        _ADDR[id(m)] = np.frombuffer(m, dtype=np.uint8).ctypes.data
    return _ADDR[id(m)]


def gpu(torch, maps, pieces, pool, threads: int, results: dict) -> None:
    total = sum(len(m) for m in maps)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    offsets, at = [], 0
    for m in maps:
        offsets.append(at)
        at += len(m)
    torch.cuda.synchronize()

    def src(p):
        return torch.frombuffer(maps[p[0]], dtype=torch.uint8, count=p[2], offset=p[1])

    def default_stream(p):
        dst[offsets[p[0]] + p[1]: offsets[p[0]] + p[1] + p[2]].copy_(src(p))

    timed(f"H2D pageable, {threads} threads, default stream", results, lambda: (list(pool.map(default_stream, pieces)), torch.cuda.synchronize()))
    streams = {}

    def own_stream(p):
        s = streams.setdefault(threading.get_ident(), torch.cuda.Stream())
        with torch.cuda.stream(s):
            dst[offsets[p[0]] + p[1]: offsets[p[0]] + p[1] + p[2]].copy_(src(p))
        s.synchronize()

    timed(f"H2D pageable, {threads} threads, a stream each", results, lambda: list(pool.map(own_stream, pieces)))
    from preload.ipc.staging import Staging

    staging = Staging(torch.cuda.current_device())

    def staged(p):
        staging.send(dst.data_ptr() + offsets[p[0]] + p[1], memoryview(maps[p[0]])[p[1]: p[1] + p[2]])

    timed(f"H2D through pinned buffers of our own, {threads} threads", results,
          lambda: (list(pool.map(staged, pieces)), staging.finish()))
    cudart = torch.cuda.cudart()
    registered = []

    def register():
        for m in maps:
            # cudaHostRegisterReadOnly (8): a read-only file mapping pinned in place
            err = cudart.cudaHostRegister(_addr(m), len(m), 8)
            registered.append((m, int(err)))

    timed("cudaHostRegister (read-only) of every file", results, register)
    results["register_errors"] = [e for _, e in registered]
    if all(e == 0 for _, e in registered):
        timed(f"H2D registered, {threads} threads, a stream each", results,
              lambda: list(pool.map(own_stream, pieces)))
        timed("cudaHostUnregister", results, lambda: [cudart.cudaHostUnregister(_addr(m)) for m, _ in registered])


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else (os.cpu_count() or 8))
