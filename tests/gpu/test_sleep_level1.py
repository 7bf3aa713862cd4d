"""Sleep level 1 on a GPU (issue 37): the weights go to host memory and the device memory
the daemon and its workers held is freed but for the daemon's own CUDA context and the
kept spare's context and decode graphs (another process can allocate it), the wake puts
the same bytes back (the same fingerprint, no load) and serves the same greedy output; the
daemon killed meanwhile, nothing is left on the device; cycles leak no device memory."""

import subprocess
import sys

import pytest
from daemons import free_port, preload, running_daemon, wait_for
from supervised import complete, logs, start_args

from preload.ipc.devices import memory_info

pytestmark = pytest.mark.gpu

ALLOCATE = "import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda:0'); print('ok')"
CONTEXT = "from preload.ipc.devices import make_current; make_current(0); print('ok', flush=True); input()"
# Asleep, the device holds the daemon's context and a kept spare's: its own context (its
# kernels loaded, a cuBLAS workspace for each stream it ran on: two) and its graphs.
KEPT_SPARE_BOUND = 3


def used() -> int:
    free, total = memory_info("cuda:0")
    return total - free


def text(port: int) -> str:
    return complete(port, max_tokens=16)["choices"][0]["text"]


def a_context() -> int:
    """The device memory a process holding a CUDA context as the daemon does (the driver's
    primary context, no allocation) costs: ~524 MiB on an H100."""
    before = used()
    p = subprocess.Popen([sys.executable, "-c", CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        return used() - before
    finally:
        p.kill()
        p.wait()


def test_level_1_frees_the_device_and_the_wake_serves_the_same_bytes(model_dir, tmp_path):
    context = a_context()
    baseline = used()
    port = free_port()
    args = (*start_args(port, 1, "--spare-workers", 1), "--device", "cuda:0", "--gpu-memory-utilization", "0.5")
    with running_daemon(tmp_path / "state", model_dir, *args) as d:
        assert wait_for(lambda: [s["state"] for s in d.status()["spares"]] == ["standby"], timeout=300), \
            (d.status()["spares"], logs(d.state_dir))
        before, fingerprint, held = text(port), d.status()["fingerprint"], used() - baseline
        arena = d.status()["data_parallel"][0]["bytes"]
        for cycle in range(3):
            r = preload("sleep", "--state-dir", d.state_dir, "--level", "1", timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            assert d.status()["sleep"]["host_bytes"] == arena  # (the weights, in host memory now)
            left = used() - baseline  # (contexts: the daemon's, the kept spare's)
            assert left <= KEPT_SPARE_BOUND * context, (cycle, left, context, held)
            got = subprocess.run([sys.executable, "-c", ALLOCATE, str(int(0.9 * held))], capture_output=True, text=True,
                                 timeout=120)
            assert got.stdout.strip() == "ok", got.stderr[-2000:]
            r = preload("wake", "--state-dir", d.state_dir, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            assert d.status()["fingerprint"] == fingerprint and not d.status()["readopted"]
            assert text(port) == before
        assert used() - baseline <= held * 1.03  # (three cycles: nothing left behind on the device)


def test_an_arena_moved_to_host_memory_comes_back_byte_for_byte(monkeypatch):
    """ipc/host_stash.py alone: a sealed cuda-vmm arena copied to host memory (in chunks,
    each page-locked, the last one short), its device memory freed (no holder left), then a
    new arena of the same bytes."""
    import os

    import torch

    from preload.ipc import host_stash
    from preload.ipc.cuda import VmmArena, VmmMapping
    from preload.ipc.layout import TensorEntry

    size = 64 << 20
    monkeypatch.setattr(host_stash, "CHUNK", 24 << 20)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    arena = VmmArena(size, "cuda:0")
    entry = TensorEntry("all", "uint8", (arena.size,), 0, arena.size)
    arena.write_part(entry, 0, memoryview(data.numpy()))
    arena.seal()
    held = host_stash.stash(arena.info(), arena.fd)
    assert held.pinned and sorted(held.registered) == [0, 24 << 20, 48 << 20], (held.registered, held.unpinned)
    free_before = memory_info("cuda:0")[0]
    arena.close()  # (the last holder: the device memory goes)
    assert wait_for(lambda: memory_info("cuda:0")[0] >= free_before + size, timeout=5)
    back = host_stash.restore(held)
    held.close()
    mapped = VmmMapping(back.info(), [os.dup(back.fd)])
    assert torch.equal(mapped.base[:size].cpu(), data)
    mapped.close()
    back.close()


def test_the_warm_spare_is_kept_through_level_1_on_the_device_and_takes_the_slot_at_the_wake(model_dir, tmp_path):
    """The sleep keeps the warm spare on the device: it lets go of the weights, their
    addresses kept, holding its context and graphs (about another context's worth on this
    model); at the wake it maps the new weights where
    the old ones were and takes the slot (preloadd/sleeping.py): the same process serves
    after the wake, with the same greedy text."""
    import psutil

    context, baseline, port = a_context(), used(), free_port()
    args = (*start_args(port, 1, "--spare-workers", 1), "--device", "cuda:0", "--gpu-memory-utilization", "0.5")
    with running_daemon(tmp_path / "state", model_dir, *args) as d:
        assert wait_for(lambda: [s["state"] for s in d.status()["spares"]] == ["standby"], timeout=300), \
            (d.status()["spares"], logs(d.state_dir))
        before, spare, held = text(port), d.status()["spares"][0]["pid"], used() - baseline
        r = preload("sleep", "--state-dir", d.state_dir, "--level", "1", timeout=300)
        assert r.returncode == 0 and "1 spare(s) kept" in r.stdout, r.stdout + r.stderr + logs(d.state_dir)
        left = used() - baseline
        assert psutil.pid_exists(spare) and left <= KEPT_SPARE_BOUND * context, (left, context, held)
        r = preload("wake", "--state-dir", d.state_dir, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert d.status()["workers"][0]["pid"] == spare, (d.status(), logs(d.state_dir))
        assert text(port) == before
        assert "1 kept spare(s) mapped the weights again" in (d.state_dir / "daemon.log").read_text()
