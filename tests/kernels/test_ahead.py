"""Kernels compiled ahead (kernels/ahead.py): a worker's kernels recorded in a list beside
the kernel cache (once each, workers sharing a cache adding to one list), and a list
compiled into a cache in forked processes without a GPU, under the key the JIT looks for:
a launch then compiles nothing. An entry that cannot compile fails alone; a list naming a
module outside preload.kernels is refused (a list is data, not code to run). The hook on
a real GPU launch is tested in tests/gpu/test_kernels_ahead.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from kernel_specs import CASES, prefill_attention_spec, rms_norm_spec  # noqa: E402

from preload.kernels import ahead  # noqa: E402

JIT_AGAIN = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from kernel_specs import CASES, H100, rms_norm_spec
import triton
from triton.compiler import compiler
built, make_ir = [], compiler.ASTSource.make_ir
compiler.ASTSource.make_ir = lambda self, *a, **kw: (built.append(self.name), make_ir(self, *a, **kw))[1]
for add, block in CASES:
    _, src, options = rms_norm_spec(add, block)
    triton.compile(src, target=H100, options=options.__dict__)
print(len(built))  # (a kernel found in the cache is loaded from there: its IR never built)
"""


COMPILE = """
import json, sys
from preload.kernels import ahead
specs = json.load(sys.stdin)
done = ahead.compile_list(specs, processes=int(sys.argv[1]))
print(json.dumps([done.kernels, {specs.index(s): why for s, why in done.failed.items()}, done.processes]))
"""


def compile_list(specs: list[str], processes: int) -> tuple[int, dict[int, str], int]:
    """ahead.compile_list in a process of its own, as `preload kernels compile` runs it: the
    kernel modules imported for real (the tests import them under Triton's interpreter)."""
    r = subprocess.run([sys.executable, "-c", COMPILE, str(processes)], input=json.dumps(specs), capture_output=True,
                       text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    kernels, failed, processes = json.loads(r.stdout)
    return kernels, {int(i): why for i, why in failed.items()}, processes


def compiled_in(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (compiled for real, as on a GPU host)
    (tmp_path / "kernels").mkdir()
    return tmp_path / "kernels"


def test_a_list_compiled_ahead_is_what_the_jit_then_finds(cache):
    assert compile_list([rms_norm_spec(add, block)[0] for add, block in CASES], processes=2) == (3, {}, 2)
    compiled = compiled_in(cache)
    assert len(compiled) == 3
    # The JIT's own path to the cache (its arguments as objects, not JSON), in another
    # process: a hit for each, nothing compiled again.
    r = subprocess.run([sys.executable, "-c", JIT_AGAIN], capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    assert compiled_in(cache) == compiled and int(r.stdout) == 0, r.stdout


def test_a_kernel_taking_tma_descriptors_compiles_ahead(cache):
    """The prefill attention reads its keys through tensor descriptors: their types travel
    in the list as strings and compile as the JIT would compile them."""
    assert compile_list([prefill_attention_spec()], processes=1) == (1, {}, 1)
    assert len(compiled_in(cache)) == 1


def test_an_entry_that_cannot_compile_fails_alone_and_foreign_modules_are_refused(cache):
    good, _, _ = rms_norm_spec(False, 1024)
    missing = json.dumps(json.loads(good) | {"name": "preload.kernels.fused_norm._no_such_kernel"})
    foreign = json.dumps(json.loads(good) | {"name": "os.system"})
    untargeted = json.dumps(json.loads(good) | {"target": None, "options": {"num_warps": 8}})
    # Recorded under another install: its libdevice path is not here (Triton's own is taken: the same key).
    elsewhere = json.loads(good)
    elsewhere["options"]["extern_libs"] = [["libdevice", "/elsewhere/triton/backends/nvidia/lib/libdevice.10.bc"]]
    kernels, failed, _ = compile_list([missing, foreign, good, untargeted, json.dumps(elsewhere)], processes=2)
    assert kernels == 5 and set(failed) == {0, 1, 3}, failed
    assert "_no_such_kernel" in failed[0] and "not a kernel of preload.kernels" in failed[1] and "no target" in failed[3]
    assert len(compiled_in(cache)) == 1
    with pytest.raises(ValueError, match="not a kernel of preload.kernels"):  # (whoever calls: the zygote's path too)
        ahead.compile_spec(json.dumps(json.loads(good) | {"name": "this.s"}))
    assert "this" not in sys.modules


HOST_CODE = """
import json, sys
from triton.backends.nvidia import driver
from preload.kernels import ahead
built, helpers = [], []
class Launcher:  # a Triton that compiles a C launcher per signature (3.6), its compiler stood in for
    def __init__(self, src, metadata):
        built.append([src.fn.__name__, list(src.signature), sorted(map(list, src.constants)), metadata.name])
driver.make_launcher, driver.CudaLauncher, driver.CudaUtils = None, Launcher, lambda: helpers.append(1)
spec = sys.stdin.read()
without = ahead.compile_share([spec])
found = ahead.compile_share([spec], launchers=True, helpers=True)  # (the kernel in the cache now)
def no_libcuda():
    raise AssertionError("libcuda.so cannot found!")
driver.library_dirs = no_libcuda
def never(src, metadata):
    raise RuntimeError("a launcher built where it cannot be")
driver.CudaLauncher = never
done = ahead.compile_list([spec], processes=1)
print(json.dumps([without, found, built, len(helpers), done.failed, done.host_code]))
"""


def test_a_kernel_compiled_ahead_has_the_launcher_built_that_its_first_launch_would(cache):
    """Where Triton builds a C launcher per kernel signature at a kernel's first launch
    (3.6, with gcc: a fresh host's first worker spent seconds there with every kernel
    compiled ahead), the launcher is built from the compiled kernel's own source and
    metadata (the key that launch looks for), with the driver's helpers once; found in the
    cache, a kernel still gets its launcher. A host without libcuda.so.1 (an image's
    build) compiles the kernels and says why their launchers were not built."""
    spec, _, _ = rms_norm_spec(True, 512)
    r = subprocess.run([sys.executable, "-c", HOST_CODE], input=spec, capture_output=True, text=True, timeout=300,
                       env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    without, found, built, helpers, failed, why = json.loads(r.stdout)
    assert without == {} and found == {} and failed == {}
    assert built == [["_rms_norm", list(json.loads(spec)["signature"]), [[11], [12]], "_rms_norm"]] and helpers == 1
    assert why == "AssertionError: libcuda.so cannot found!"
    assert len(compiled_in(cache)) == 1


def hook_call(recorder: ahead.Recorder, spec: str) -> bool:
    """Triton's call of a jit_cache_hook (keyword arguments; runtime/jit.py _call_hook)."""
    return recorder.hook(key="k", repr="r", fn=None, compile={"key": "k", "specialization_data": spec},
                         is_manual_warmup=False, already_compiled=False)


def test_a_worker_records_each_kernel_once_and_a_start_with_all_listed_writes_nothing(tmp_path):
    specs = [rms_norm_spec(add, block)[0] for add, block in CASES]
    recorder = ahead.Recorder(tmp_path)
    assert [hook_call(recorder, s) for s in specs + specs[:1]] == [False] * 4  # (never skips the compile)
    assert recorder.added == 3 and sorted(ahead.read_list(ahead.list_path(tmp_path)).values()) == sorted(specs)
    before = ahead.list_path(tmp_path).stat().st_mtime_ns
    again = ahead.Recorder(tmp_path)  # (the next start, on the same cache)
    for s in specs:
        hook_call(again, s)
    assert again.added == 0 and ahead.list_path(tmp_path).stat().st_mtime_ns == before


COUNT_COMPILES = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from kernel_specs import CASES, H100, rms_norm_spec
import triton
from preload.kernels import ahead
recorder = ahead.Recorder(os.environ["TRITON_CACHE_DIR"]).install()
for add, block in CASES[:2] + CASES[:1]:  # (the first again: found in the cache)
    _, src, options = rms_norm_spec(add, block)
    triton.compile(src, target=H100, options=options.__dict__)
print(recorder.said())
"""


def test_a_processs_kernels_are_counted_as_compiled_or_found_in_the_cache(cache):
    """What a worker's log says at ready (worker/serve.py): whether the kernels its JIT met
    were compiled then or found, e.g. compiled ahead from the list (kernels new to the list:
    the JIT's hook, not called by a direct compile)."""
    r = subprocess.run([sys.executable, "-c", COUNT_COMPILES], capture_output=True, text=True, timeout=120,
                       env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "kernels this process: 2 compiled, 1 found in the cache, 0 new to the list"


def test_a_spec_without_a_target_is_recorded_with_this_gpus(tmp_path):
    spec = json.dumps(json.loads(rms_norm_spec(True, 512)[0]) | {"target": None})  # (Triton 3.6 leaves it out)
    recorder = ahead.Recorder(tmp_path)
    recorder._target = {"backend": "cuda", "arch": 90, "warp_size": 32}  # (what the driver says on an H100/H200)
    hook_call(recorder, spec)
    (listed,) = ahead.read_list(ahead.list_path(tmp_path)).values()
    assert json.loads(listed)["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}


def _record_in_another_process(cache: str, spec: str) -> None:
    hook_call(ahead.Recorder(cache), spec)


def test_workers_sharing_a_cache_add_to_one_list(tmp_path):
    specs = [json.dumps(json.loads(rms_norm_spec(True, 512)[0]) | {"key": f"k{i}"}) for i in range(24)]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_in_another_process, args=(str(tmp_path), s)) for s in specs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(ahead.read_list(ahead.list_path(tmp_path)).values()) == sorted(specs)


def test_the_hook_installed_before_still_decides(tmp_path, monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["key"]) or True)
    recorder = ahead.Recorder(tmp_path).install()
    try:
        assert knobs.runtime.jit_cache_hook == recorder.hook
        assert hook_call(recorder, rms_norm_spec(True, 512)[0]) is True and seen == ["k"]
    finally:
        recorder.uninstall()
    assert knobs.runtime.jit_cache_hook is not recorder.hook


def test_a_damaged_list_is_said_and_written_anew(tmp_path, caplog):
    ahead.list_path(tmp_path).write_text("{not json")
    with pytest.raises(ValueError, match="is not a kernel list"):
        ahead.read_list(ahead.list_path(tmp_path))
    recorder = ahead.Recorder(tmp_path)
    assert "not a kernel list" in caplog.text
    hook_call(recorder, rms_norm_spec(True, 512)[0])  # (over the damaged file)
    assert len(ahead.read_list(ahead.list_path(tmp_path))) == 1


LISTED = """
import json, sys
from preload.kernels import ahead
from triton import knobs
first = ahead.compile_listed()
done = first.finish(120) if first else None
again = ahead.compile_listed()  # (the marker says the cache has them all)
print(json.dumps([len(first.pids) if first else 0, done, again is None]))
"""


def test_a_cache_lacking_what_its_list_names_compiles_it_in_forked_children_once(cache):
    specs = [rms_norm_spec(add, block)[0] for add, block in CASES]
    ahead.write_list(ahead.list_path(cache), {ahead.entry_digest(s): s for s in specs})

    def run() -> list:
        r = subprocess.run([sys.executable, "-c", LISTED], capture_output=True, text=True, timeout=300, env=os.environ)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    processes = min(3, len(os.sched_getaffinity(0)))
    assert run() == [processes, True, True]
    assert len(compiled_in(cache)) == 3 and len(list(cache.glob("preload-compiled-*"))) == 1
    assert run() == [0, None, True]  # (a start on the same cache: nothing forked)
    more = json.dumps(json.loads(specs[0]) | {"options": json.loads(specs[0])["options"] | {"num_warps": 8}})
    ahead.write_list(ahead.list_path(cache), {ahead.entry_digest(s): s for s in specs + [more]})
    assert run()[1:] == [True, True] and len(compiled_in(cache)) == 4  # (a worker listed one more)


def test_children_that_outlast_the_wait_are_killed_and_reaped():
    import time

    pids = [os.fork() or (time.sleep(30), os._exit(0)) for _ in range(2)]
    t0 = time.monotonic()
    assert ahead.wait_compiles(pids, 0.2) is False and time.monotonic() - t0 < 5
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_core_forked_while_kernels_compile_ahead_waits_for_them_and_a_front_does_not(tmp_path):
    """The zygote answers forks at once while its children compile (a fork must be answered
    within seconds); a core it forks meanwhile waits until they have all exited, or the
    deadline passes, before its first step; a front goes on at once; each closes the pipe."""
    import time

    ready, held = os.pipe()
    child = os.fork()
    if child == 0:  # (a compiling child: holds the write end until it exits)
        os.close(ready)
        time.sleep(0.5)
        os._exit(0)
    os.close(held)
    compiling = ahead.Compiling([child], tmp_path / "marker", ready)
    assert not compiling.settled()
    fd, until = compiling.handed()["compiles"]

    def forked(role: str, deadline: float = until) -> float:  # (a forked worker's own copy of the fd)
        copy, t0 = os.dup(fd), time.monotonic()
        ahead.wait_compiled({"role": role, "compiles": [copy, deadline]})
        with pytest.raises(OSError):
            os.fstat(copy)
        return time.monotonic() - t0

    assert forked("front") < 0.2 and forked("core", time.monotonic() - 1) < 0.2  # (past the deadline: no wait)
    assert 0.2 < forked("core") < 10
    assert compiling.settled() and (tmp_path / "marker").exists()  # (reaped; all compiled: the cache marked)
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)


def test_a_zygote_asked_for_nothing_more_still_settles_its_compiles_when_they_end(tmp_path):
    """A zygote whose only worker was forked while its children compiled (one worker, no
    spare) reaps them and marks the cache when they end, without a later fork request; a
    request that comes first is answered first."""
    import socket
    import time

    def compiling_for(seconds: float) -> ahead.Compiling:
        ready, held = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(ready)
            time.sleep(seconds)
            os._exit(0)
        os.close(held)
        return ahead.Compiling([child], tmp_path / f"marker-{seconds}", ready)

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    compiling = compiling_for(0.3)
    t0 = time.monotonic()
    assert compiling.settled_unless_asked(ours) and 0.25 < time.monotonic() - t0 < 10
    assert (tmp_path / "marker-0.3").exists()

    compiling = compiling_for(2)
    theirs.send(b"{}")  # (a fork request waits already)
    t0 = time.monotonic()
    assert not compiling.settled_unless_asked(ours) and time.monotonic() - t0 < 1
    assert not (tmp_path / "marker-2").exists()
    assert ahead.wait_compiles(compiling.pids, 10)
    os.close(compiling.ready_fd)
    ours.close(), theirs.close()
