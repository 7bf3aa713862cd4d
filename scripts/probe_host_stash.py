"""Probe (issue 37): how fast sleep level 1 moves a V2-Lite-sized arena to host memory and
back (ipc/host_stash.py), registered whole as before cb33fc9 or a chunk at a time with
threads faulting the next chunks in.

A cuda-vmm arena of --gib GiB (a random MiB at each end, the rest one value) is stashed and
restored once per way; the restored arena's ends are read back and compared. Prints one
line per way: stash and restore seconds, GiB/s, whether every chunk was page-locked, and
whether the bytes came back. Needs ~2x --gib of device memory and --gib of host memory.

    python3 scripts/probe_host_stash.py [--gib 29] | tee $OUT/probe-host-stash.txt
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from preload.ipc import host_stash
from preload.ipc.cuda import VmmArena, VmmMapping

MIB = 1 << 20


def filled_arena(size: int) -> tuple[VmmArena, torch.Tensor, torch.Tensor]:
    arena = VmmArena(size, "cuda:0")
    t = arena.as_tensor()
    t[:MIB].random_(0, 255)
    t[-MIB:].random_(0, 255)
    t[MIB:-MIB].fill_(7)
    head, tail = t[:MIB].clone(), t[-MIB:].clone()
    torch.cuda.synchronize()
    arena.seal()
    return arena, head, tail


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=29.0)
    size = int(ap.parse_args().gib * (1 << 30))
    arena, head, tail = filled_arena(size)
    populate = host_stash._populate
    ways = (("whole: one registration, pages faulted in by it", size, 1, lambda address, n: None),
            ("chunks of 1 GiB, 8 threads faulting ahead", 1 << 30, 8, populate))
    for label, chunk, threads, fault_in in ways:
        host_stash.CHUNK, host_stash.POPULATE_THREADS, host_stash._populate = chunk, threads, fault_in
        t = time.perf_counter()
        held = host_stash.stash(arena.info(), arena.fd)
        stashed = time.perf_counter() - t
        t = time.perf_counter()
        back = host_stash.restore(held)
        restored = time.perf_counter() - t
        seen = VmmMapping(back.info(), [os.dup(back.fd)])
        same = torch.equal(seen.base[:MIB], head) and torch.equal(seen.base[size - MIB:size], tail)
        seen.close()
        gib = size / (1 << 30)
        print(f"{label:50s} stash {stashed:6.2f} s ({gib / stashed:5.1f} GiB/s) page-locked={held.pinned}"
              f" {held.unpinned or ''}; restore {restored:5.2f} s ({gib / restored:5.1f} GiB/s); same bytes={same}",
              flush=True)
        held.close()
        back.close()


if __name__ == "__main__":
    main()
