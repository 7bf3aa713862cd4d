"""The fp8 kernel (ipc/fp8_device.py) is never compiled for a GPU without e4m3 in
hardware: torch quantizes there. (A kernel that does not compile: tests/ipc/test_nvrtc.py;
the kernel itself runs on a GPU: tests/gpu/test_fp8_device.py.)"""

from __future__ import annotations

from preload.ipc import fp8_device, nvrtc


def test_a_gpu_without_e4m3_is_never_compiled_for(monkeypatch):
    def compiles(source, name, arch):
        raise AssertionError("compiled for a GPU without e4m3")

    monkeypatch.setattr(nvrtc, "capability", lambda ordinal: (8, 0))
    monkeypatch.setattr(nvrtc, "compile_cubin", compiles)
    assert fp8_device.available(0) is False
