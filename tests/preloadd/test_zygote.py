"""The zygote on its own (preloadd/zygote.py): launched with nothing but its state dir, it
imports, then takes what its workers start with from the daemon's first message; for GPU
workers it imports their Triton kernels before it says it is ready, for CPU workers it never
loads Triton."""

from __future__ import annotations

import selectors
import socket

import pytest

from preload.options import ServeOptions
from preload.preloadd.zygote import Zygote, code_version, worker_spec


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-workers", "cuda-workers"])
def test_a_zygote_for_gpu_workers_has_triton_loaded_before_it_is_ready(tmp_path, gpu):
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        api.listen()
        z = Zygote(tmp_path, code_version())
        try:
            z.configure(worker_spec(ServeOptions(state_dir=tmp_path), gpu), api.fileno())
            with selectors.DefaultSelector() as sel:
                sel.register(z.sock, selectors.EVENT_READ)
                assert sel.select(timeout=120), "the zygote did not get ready"
            assert z.accept_ready()
            with open(f"/proc/{z.pid}/maps") as f:
                libraries = f.read()
            assert "libtorch" in libraries
            assert ("libtriton" in libraries) == gpu
            assert z.proc.poll() is None
        finally:
            z.retire()
            assert z.proc.wait(timeout=30) == 0  # (it exits when its channel closes)
            z.close()
