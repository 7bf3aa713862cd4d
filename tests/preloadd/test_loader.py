"""The loader says where a load's time went (plan, read, hash, upload, quantize,
write, publish: /status progress.stage_seconds, printed by `preload bench cold`); it
passes over each source tensor once, a chunk at a time, whatever the chunk; and the
memfd arena's allocating thread never outlives it."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from checkpoints import with_a_bad_last_value

from preload.checkpoint import identity
from preload.ipc.memfd import MemfdArena
from preload.preloadd.loader import load
from preload.preloadd.weights import STAGES, LoadError, Progress


def test_every_stage_of_a_load_is_timed(tiny_checkpoint):
    progress = Progress()
    loaded = load(tiny_checkpoint, "fp8_block", torch.float32, torch.device("cpu"), "memfd", progress)
    try:
        stages = progress.stages
        assert list(stages) == list(STAGES)
        assert all(v >= 0 for v in stages.values())
        assert all(stages[k] > 0 for k in ("plan", "read", "hash", "quantize", "write", "publish")), stages
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


def arena_bytes(loaded) -> bytes:
    return os.pread(loaded.arena.fd, loaded.arena.size, 0)


@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_one_pass_a_chunk_at_a_time_stores_the_same_bytes_and_fingerprint(tiny_checkpoint, monkeypatch, quant):
    """Each source tensor is hashed, checked and (host arena, stored as read) written a
    chunk at a time in one pass: with 64-byte chunks, many per tensor, the arena holds the
    same bytes and the manifest the same fingerprint as with whole tensors in one chunk."""
    loads = []
    for chunk in (1 << 40, 64):
        monkeypatch.setattr(identity, "CHUNK_BYTES", chunk)
        progress = Progress()
        loaded = load(tiny_checkpoint, quant, torch.float32, torch.device("cpu"), "memfd", progress)
        loads.append((arena_bytes(loaded), loaded.manifest.fingerprint, progress.stages))
        loaded.arena.close()
    (whole, fp_whole, _), (chunked, fp_chunked, stages) = loads
    assert chunked == whole and fp_chunked == fp_whole
    if quant == "none":  # every tensor went in during the pass: none was uploaded or written after it
        assert stages["upload"] == stages["write"] == 0, stages


def test_a_nan_in_the_last_chunk_of_a_tensor_is_named(tiny_checkpoint, tmp_path, monkeypatch):
    model, name = with_a_bad_last_value(tiny_checkpoint, tmp_path / "model", float("nan"))
    monkeypatch.setattr(identity, "CHUNK_BYTES", 256)
    with pytest.raises(LoadError, match=f"tensor {name} holds NaN or Inf"):
        load(model, "none", torch.float32, torch.device("cpu"), "memfd", Progress())
