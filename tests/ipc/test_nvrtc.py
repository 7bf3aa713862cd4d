"""Kernels compiled at run time (ipc/nvrtc.py) are compiled once per process, whichever
thread asks first, and one that does not compile is tried, and said in the log, once: the
load then does that part another way (torch quantizes; the host checks for NaN and Inf). (The kernels themselves run on a GPU:
tests/gpu/test_fp8_device.py, tests/gpu/test_finite_device.py.)"""

from __future__ import annotations

import logging
import threading

import pytest

from preload.ipc import finite_device, fp8_device, nvrtc


def test_a_kernel_that_does_not_compile_is_tried_and_reported_once(monkeypatch, caplog):
    tries = []

    def fails(source, name, arch):
        tries.append((name, arch))
        raise RuntimeError("nvrtcCompileProgram failed")

    monkeypatch.setattr(nvrtc, "capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(nvrtc, "compile_cubin", fails)
    nvrtc._cached.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=nvrtc.log.name):
            threads = [threading.Thread(target=nvrtc.cubin, args=("src", "k", 3, "done without k")) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert nvrtc.cubin("src", "k", 3, "done without k") is None
        assert tries == [("k", "sm_90")]
        assert [r.getMessage() for r in caplog.records] == ["done without k: nvrtcCompileProgram failed"]
    finally:
        nvrtc._cached.cache_clear()  # (no other test inherits the made-up failure)


def test_each_kernel_and_gpu_is_compiled_for_once(monkeypatch):
    compiled = []

    def compiles(source, name, arch):
        compiled.append((name, arch))
        return f"{name} for {arch}".encode()

    monkeypatch.setattr(nvrtc, "capability", lambda ordinal: (9, ordinal))
    monkeypatch.setattr(nvrtc, "compile_cubin", compiles)
    nvrtc._cached.cache_clear()
    try:
        for _ in range(2):
            assert nvrtc.cubin("a", "a", 0, "") == b"a for sm_90"
            assert nvrtc.cubin("b", "b", 0, "") == b"b for sm_90"
            assert nvrtc.cubin("a", "a", 1, "") == b"a for sm_91"
        assert compiled == [("a", "sm_90"), ("b", "sm_90"), ("a", "sm_91")]
    finally:
        nvrtc._cached.cache_clear()


@pytest.mark.parametrize("kernel", [fp8_device, finite_device], ids=lambda m: m.KERNEL)
def test_a_load_does_without_a_kernel_that_does_not_compile(monkeypatch, kernel):
    def fails(source, name, arch):
        raise RuntimeError("nvrtcCompileProgram failed")

    monkeypatch.setattr(nvrtc, "capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(nvrtc, "compile_cubin", fails)
    nvrtc._cached.cache_clear()
    try:
        assert kernel.available(0) is False
    finally:
        nvrtc._cached.cache_clear()
