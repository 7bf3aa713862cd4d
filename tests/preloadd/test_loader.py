"""The loader says where a load's time went (plan, read, hash, upload, check, quantize,
write, publish: /status progress.stage_seconds, printed by `preload bench cold`), and
the memfd arena's allocating thread never outlives it."""

from __future__ import annotations

import os
import threading

import torch

from preload.ipc.memfd import MemfdArena
from preload.preloadd.loader import load
from preload.preloadd.weights import STAGES, Progress


def test_every_stage_of_a_load_is_timed(tiny_checkpoint):
    progress = Progress()
    loaded = load(tiny_checkpoint, "fp8_block", torch.float32, torch.device("cpu"), "memfd", progress)
    try:
        stages = progress.stages
        assert list(stages) == list(STAGES)
        assert all(v >= 0 for v in stages.values())
        assert all(stages[k] > 0 for k in ("plan", "read", "hash", "check", "quantize", "write", "publish")), stages
        # plan and publish are parts of the wall clock; the others are summed over threads
        assert stages["plan"] + stages["publish"] <= progress.seconds
        assert progress.as_dict()["stage_seconds"] == stages
    finally:
        loaded.arena.close()


def test_the_arena_allocates_ahead_and_its_thread_ends_with_it():
    arena = MemfdArena(256 << 20)
    arena.close()  # (at once: the thread stops between chunks)
    assert not any(t.name == "arena-allocate" and t.is_alive() for t in threading.enumerate())
    arena = MemfdArena(8 << 20)
    arena.seal()  # waits for the allocation: every page is there before the seals go on
    assert os.fstat(arena.fd).st_blocks * 512 >= 8 << 20
    arena.close()
