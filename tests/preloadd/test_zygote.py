"""The zygote on its own (preloadd/zygote.py, zygote_process.py): launched with nothing but its state dir, it
imports, then takes what its workers start with from the daemon's first message. It forks,
so it has no threads. Its fronts' HTTP stack, and for GPU workers their Triton kernels, it
imports once it is ready, a step at a time while no fork request waits; for CPU workers it
never loads Triton."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time

import pytest

from preload.options import ServeOptions
from preload.preloadd.install import code_version
from preload.preloadd.zygote import Zygote, worker_spec


def ready_zygote(tmp_path, api: socket.socket, gpu: bool) -> Zygote:
    z = Zygote(tmp_path, code_version())
    try:
        z.configure(worker_spec(ServeOptions(state_dir=tmp_path), gpu), api.fileno())
        with selectors.DefaultSelector() as sel:
            sel.register(z.sock, selectors.EVENT_READ)
            assert sel.select(timeout=120), "the zygote did not get ready"
        assert z.accept_ready()
    except BaseException:
        z.discard()
        raise
    return z


def mapped(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


@pytest.fixture
def api():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-workers", "cuda-workers"])
def test_a_zygote_for_gpu_workers_loads_triton_after_it_is_ready_and_one_for_cpu_workers_never(tmp_path, api, gpu):
    z = ready_zygote(tmp_path, api, gpu)
    try:
        assert mapped(z.pid, "libtorch")
        deadline = time.monotonic() + (120 if gpu else 1)
        while not mapped(z.pid, "libtriton") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mapped(z.pid, "libtriton") == gpu
        assert z.proc.poll() is None
    finally:
        z.retire()
        assert z.proc.wait(timeout=30) == 0  # (it exits when its channel closes)
        z.close()


def test_a_zygote_is_ready_with_what_a_core_imports_and_imports_the_http_stack_after(tmp_path, api):
    """A core needs no HTTP stack: what a zygote imports before it is ready leaves it out (a
    start's first front, forked at once, imports it itself beside its core's start), and the
    zygote imports it once ready, for the fronts forked later (pydantic's native part mapped)."""
    probe = "import sys, preload.worker.serve; print([m for m in ('fastapi', 'uvicorn', 'pydantic') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "[]\n"
    z = ready_zygote(tmp_path, api, False)
    try:
        deadline = time.monotonic() + 60
        while not mapped(z.pid, "pydantic_core") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mapped(z.pid, "pydantic_core")
    finally:
        z.retire()
        assert z.proc.wait(timeout=30) == 0
        z.close()


def test_a_ready_zygote_has_one_thread_though_numpy_starts_blas_threads_at_import(tmp_path, api):
    z = ready_zygote(tmp_path, api, gpu=False)
    try:
        assert len(os.listdir(f"/proc/{z.pid}/task")) == 1
        with open(f"/proc/{z.pid}/stat") as f:  # what Python 3.12 reads at a fork: the thread count is its 20th field
            assert int(f.read().split(" ")[19]) == 1
    finally:
        z.retire()
        z.proc.wait(timeout=30)
        z.close()


def test_a_python_that_compiles_torch_at_every_import_is_noticed(tmp_path):
    """Where a package has no cached bytecode and Python writes none (PYTHONDONTWRITEBYTECODE,
    as on the H200 machine's image), every zygote compiles torch's 2,000 modules again:
    seconds of each cold start. The daemon says so in its log, and `bench cold` in its
    machine line; a package compiled once (`compileall`), or a Python that caches what
    it compiles, is not reported."""
    import compileall
    import subprocess
    import sys

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("x = 1\n")
    code = "from preload.preloadd.install import compiles_from_source; print(compiles_from_source('pkg'))"

    def reported(*flags: str) -> str:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert reported("-B") == "True"  # -B: writes no bytecode
    assert reported() == "False"  # it will cache what it compiles
    assert compileall.compile_dir(tmp_path / "pkg", quiet=1)
    assert reported("-B") == "False"


def test_a_bytecode_prefix_without_the_standard_library_is_noticed(tmp_path):
    """With PYTHONPYCACHEPREFIX set, Python looks for all bytecode under the prefix and
    ignores the __pycache__ folders beside the sources: a prefix filled with a package's
    bytecode (as the GPU machine's runs filled it with torch's) leaves the standard library
    compiled at every start where nothing is written (`preload --help` 0.07 s, 0.29 s with an
    empty prefix)."""
    import compileall
    import subprocess
    import sys

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("x = 1\n")
    prefix = tmp_path / "pyc"
    code = ("from preload.preloadd.install import compiles_from_source, uncompiled_imports;"
            " print(compiles_from_source('pkg'), 'the standard library' in uncompiled_imports())")

    def reported(*flags: str) -> str:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "PYTHONPYCACHEPREFIX": str(prefix)}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert compileall.compile_dir(tmp_path / "pkg", quiet=1)  # beside the source: not where the prefix looks
    assert reported("-B") == "True True"
    assert reported() == "False False"  # the prefix is written: each is compiled once
    env_prefix = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pyc2")}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tmp_path / "pkg")], env=os.environ | env_prefix, check=True)
    prefix = tmp_path / "pyc2"
    assert reported("-B") == "False True"  # the package in the prefix; the library still not
