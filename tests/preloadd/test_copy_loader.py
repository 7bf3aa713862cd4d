"""A load with no arithmetic to do (`--quant none`, the checkpoint already in the model's
dtype) is a copy, made without torch (and so is fp8_block into a GPU that quantizes:
tests/gpu/test_cuda.py; its plan is checked here): the same arena bytes, layout and
fingerprint as the loader that computes, whatever the chunk; a bfloat16 router weight
widened to float32 bit for bit; a NaN named; any load that must compute left to the
other loader; and a daemon that loads so is ready without ever mapping libtorch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import with_a_bad_last_value
from daemons import running_daemon
from safetensors.torch import load_file, save_file

from preload.checkpoint import identity
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.finite import all_finite
from preload.ipc import fp8_device
from preload.ipc.arena import create_arena
from preload.preloadd import copy_loader, loader
from preload.preloadd.copy_loader import copy_plan, load_copied
from preload.preloadd.loader import load
from preload.preloadd.weights import LoadCancelled, LoadError, Progress


def arena_bytes(loaded) -> bytes:
    return os.pread(loaded.arena.fd, loaded.arena.size, 0)


def both_loads(model: Path, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """(bytes, manifest) of the copy and of the computing loader, each arena closed."""
    out = []
    for copied in (True, False):
        name = str(dtype).removeprefix("torch.")
        progress = Progress()
        loaded = (load_copied(model, "none", name, "cpu", "memfd", progress) if copied
                  else load(model, "none", dtype, torch.device("cpu"), "memfd", progress))
        assert loaded is not None
        out.append((arena_bytes(loaded), loaded.manifest, progress))
        loaded.arena.close()
    return out[0], out[1]


def as_bfloat16(tiny_checkpoint: Path, to: Path) -> Path:
    """The tiny checkpoint saved in bfloat16, its config saying so (the router too: widened at load)."""
    shutil.copytree(tiny_checkpoint, to)
    (path,) = to.glob("*.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)
    config = (to / "config.json").read_text().replace('"float32"', '"bfloat16"')
    (to / "config.json").write_text(config)
    return to


@pytest.mark.parametrize("chunk", [1 << 40, 64])
def test_a_copy_stores_what_the_computing_loader_stores(tiny_checkpoint, monkeypatch, chunk):
    monkeypatch.setattr(identity, "CHUNK_BYTES", chunk)
    (copied, copied_manifest, progress), (computed, computed_manifest, _) = both_loads(tiny_checkpoint, torch.float32)
    assert copied == computed
    assert copied_manifest.to_wire() == computed_manifest.to_wire()  # layout, record, fingerprint, settings
    assert progress.stages["read"] > 0 and progress.stages["hash"] > 0 and progress.stages["write"] > 0
    assert progress.stages["quantize"] == progress.stages["upload"] == 0
    assert progress.done_bytes == progress.total_bytes and progress.seconds > 0


def test_a_bfloat16_router_weight_is_widened_bit_for_bit(tiny_checkpoint, tmp_path):
    model = as_bfloat16(tiny_checkpoint, tmp_path / "bf16")
    (copied, manifest, _), (computed, computed_manifest, _) = both_loads(model, torch.bfloat16)
    widened = [n for n, d in zip(manifest.layout.name, manifest.layout.dtype) if d == "float32"]
    assert widened and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias")) for n in widened)
    assert copied == computed and manifest.fingerprint == computed_manifest.fingerprint


def test_loads_that_must_compute_are_left_to_the_other_loader(tiny_checkpoint, tmp_path):
    assert copy_plan(tiny_checkpoint, "none", "float32", "memfd", "cpu") is not None
    assert copy_plan(tiny_checkpoint, "fp8_block", "float32", "memfd", "cpu") is None  # quantized
    assert copy_plan(tiny_checkpoint, "none", "bfloat16", "memfd", "cpu") is None  # float32 files, converted
    assert copy_plan(tiny_checkpoint, "none", "float32", "cuda-ipc", "cuda") is None  # (its arena wants torch)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (path,) = broken.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:-10])  # truncated: the other loader says so, as for any load
    assert copy_plan(broken, "none", "float32", "memfd", "cpu") is None
    assert load_copied(broken, "none", "float32", "cpu", "memfd", Progress()) is None


def test_a_nan_is_named_and_nothing_is_left_behind(tiny_checkpoint, tmp_path, monkeypatch):
    model, name = with_a_bad_last_value(tiny_checkpoint, tmp_path / "model", float("inf"))
    monkeypatch.setattr(identity, "CHUNK_BYTES", 256)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LoadError, match=f"tensor {name} holds NaN or Inf"):
        load_copied(model, "none", "float32", "cpu", "memfd", Progress())
    assert len(os.listdir("/proc/self/fd")) == fds  # the arena's memfd and the files' fds are closed


@pytest.mark.parametrize("copied", [True, False], ids=["copy", "computing"])
def test_a_load_cancelled_midway_ends_at_the_next_chunk_and_leaves_nothing(tiny_checkpoint, monkeypatch, copied):
    """Issue 36: `preload stop` during a load waited for the tensors in flight to be read
    to the end (7-19 s on a cold disk) and a worker could start after it. Cancelled after
    the first tensor, each loader's threads stop at their next chunk: few tensors more are
    done, no chunk is read after the cancel, the arena and the files' fds are closed."""
    monkeypatch.setattr(identity, "CHUNK_BYTES", 256)  # (many chunks a tensor: a stop is seen mid-tensor)
    progress, chunks_before, chunks_after = Progress(), [], []

    def on_progress(p: Progress) -> None:
        p.cancelled.set()  # as the daemon's SIGTERM handler does

    def counting_all_finite(dtype, chunk):  # (each chunk's first work in both loaders)
        (chunks_after if progress.cancelled.is_set() else chunks_before).append(len(chunk))
        return all_finite(dtype, chunk)

    monkeypatch.setattr(copy_loader, "all_finite", counting_all_finite)
    monkeypatch.setattr(loader, "all_finite", counting_all_finite)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LoadCancelled, match="the daemon is stopping"):
        if copied:
            load_copied(tiny_checkpoint, "none", "float32", "cpu", "memfd", progress, on_progress)
        else:
            load(tiny_checkpoint, "none", torch.float32, torch.device("cpu"), "memfd", progress, on_progress)
    threads = min(os.cpu_count() or 1, copy_loader.LOADER_THREADS if copied else loader.LOADER_THREADS)
    assert 1 <= progress.tensors_done <= threads, progress.tensors_done  # (the first, and those already past their last chunk)
    assert progress.tensors_done < progress.tensors_total
    assert chunks_before and chunks_after == []  # no chunk was worked on after the cancel
    assert len(os.listdir("/proc/self/fd")) == fds


class CheckedByDevice:
    """A memfd arena that checks NaN/Inf itself, as a cuda-vmm arena has the GPU do
    (ipc/finite_device.py): each check_finite queued, all done by first_nonfinite."""

    def __init__(self, arena):
        self.arena, self.queued = arena, []

    def __getattr__(self, name):
        return getattr(self.arena, name)

    def check_finite(self, entry, tag):
        self.queued.append((entry, tag))

    def first_nonfinite(self):
        data = [(os.pread(self.arena.fd, e.nbytes, e.offset), e.dtype, tag) for e, tag in self.queued]
        return min((tag for b, dtype, tag in data if not all_finite(dtype, b)), default=0)


def test_a_load_whose_arena_checks_names_the_bad_tensor_after_every_copy(tiny_checkpoint, tmp_path, monkeypatch):
    """With the check on the device, the loader threads check nothing themselves; the
    arena's first bad tag is the tensor named, and the arena goes."""
    model, name = with_a_bad_last_value(tiny_checkpoint, tmp_path / "model", float("nan"))
    plan = copy_plan(model, "none", "float32", "memfd", "cpu")
    assert plan is not None and not plan.checked_on_device  # (host memory: the host checks)
    plan.checked_on_device = True
    arenas = []

    def arena_that_checks(transport, size, device):
        arenas.append(CheckedByDevice(create_arena(transport, size, device)))
        return arenas[-1]

    def host_check(dtype, data):
        raise AssertionError("checked on the host too")

    monkeypatch.setattr(copy_loader, "create_arena", arena_that_checks)
    monkeypatch.setattr(copy_loader, "all_finite", host_check)
    with pytest.raises(LoadError, match=f"tensor {name} holds NaN or Inf"):
        load_copied(model, "none", "float32", "cpu", "memfd", Progress(), plan=plan)
    (arena,) = arenas
    assert {e.name for e, _ in arena.queued} == set(plan.stored)  # every tensor checked, every copy made
    assert arena.arena.fd == -1  # (closed: the memory went with it)


def test_a_copy_imports_no_torch(tiny_checkpoint):
    code = (f"import sys; from pathlib import Path; from preload.preloadd.copy_loader import load_copied; "
            f"from preload.preloadd.weights import Progress; "
            f"l = load_copied(Path({str(tiny_checkpoint)!r}), 'none', 'float32', 'cpu', 'memfd', Progress()); "
            f"print(l.manifest.fingerprint, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    computed = load(tiny_checkpoint, "none", torch.float32, torch.device("cpu"), "memfd", Progress())
    computed.arena.close()
    assert out == [computed.manifest.fingerprint, "[]"]


def test_a_daemon_that_copies_its_weights_never_maps_torch(tiny_checkpoint, tmp_path):
    with running_daemon(tmp_path / "state", tiny_checkpoint, "--quant", "none") as d:
        s = d.status()
        assert s["state"] == "ready"
        assert "libtorch" not in Path(f"/proc/{s['pid']}/maps").read_text()


def test_a_plan_that_quantizes_on_the_gpu_lays_the_arena_out_as_the_computing_loader(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch):
    model = as_bfloat16(tiny_checkpoint, tmp_path / "bf16")
    monkeypatch.setattr(fp8_device, "available", lambda ordinal: True)  # (a GPU's answer: tests/gpu load with it)
    plan = copy_plan(model, "fp8_block", "bfloat16", "cuda-vmm", "cuda:0")
    entries, size, _ = loader.plan(ModelConfig.from_dir(model), model, "fp8_block", torch.bfloat16)
    assert plan is not None and (plan.entries, plan.size) == (entries, size)
    by_name = {e.name: e for e in plan.entries}
    assert plan.quantized and all(by_name[q].dtype == "float8_e4m3fn" and by_name[s].dtype == "float32"
                                  for q, s in plan.quantized.values())
    assert copy_plan(model, "fp8_block", "bfloat16", "memfd", "cpu") is None  # (quantized with torch on a CPU)
    assert copy_plan(model, "fp8_per_tensor", "bfloat16", "cuda-vmm", "cuda:0") is None
    assert copy_plan(tiny_checkpoint, "fp8_block", "float32", "cuda-vmm", "cuda:0") is None  # float32 files
    monkeypatch.setattr(fp8_device, "available", lambda ordinal: False)  # no e4m3 in hardware, or no NVRTC
    assert copy_plan(model, "fp8_block", "bfloat16", "cuda-vmm", "cuda:0") is None
