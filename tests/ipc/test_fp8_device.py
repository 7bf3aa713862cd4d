"""Whether the fp8 kernel can quantize on a GPU (ipc/fp8_device.py) is decided once per
process: a daemon's start asks from its CUDA thread and its load's plan asks again, and a
kernel that does not compile is compiled, and said in the log, once. (The kernel itself is
tested on a GPU: tests/gpu/test_fp8_device.py.)"""

from __future__ import annotations

import logging

from preload.ipc import fp8_device


def test_a_kernel_that_does_not_compile_is_tried_and_reported_once(monkeypatch, caplog):
    tries = []

    def fails(ordinal):
        tries.append(ordinal)
        raise RuntimeError("nvrtcCompileProgram failed")

    monkeypatch.setattr(fp8_device, "capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(fp8_device, "_nvrtc", lambda: object())
    monkeypatch.setattr(fp8_device, "_cubin", fails)
    fp8_device._compiles.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=fp8_device.log.name):
            assert fp8_device.available(3) is False
            assert fp8_device.available(3) is False
        assert tries == [3]
        assert [r.getMessage() for r in caplog.records] == [
            "fp8 quantized with torch, not by our kernel: nvrtcCompileProgram failed"]
    finally:
        fp8_device._compiles.cache_clear()  # (no other test inherits the made-up failure)


def test_a_gpu_without_e4m3_is_never_compiled_for(monkeypatch):
    def compiles(ordinal):
        raise AssertionError("compiled for a GPU without e4m3")

    monkeypatch.setattr(fp8_device, "capability", lambda ordinal: (8, 0))
    monkeypatch.setattr(fp8_device, "_cubin", compiles)
    assert fp8_device.available(0) is False
