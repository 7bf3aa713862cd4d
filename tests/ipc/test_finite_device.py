"""The GPU's NaN/Inf check (ipc/finite_device.py) takes every float dtype a checkpoint
stores in 1, 2 or 4 bytes and leaves float64 to the host. (A kernel that does not
compile: tests/ipc/test_nvrtc.py; the kernel itself runs on a GPU:
tests/gpu/test_finite_device.py.)"""

from __future__ import annotations

from preload.ipc import finite_device


def test_the_dtypes_the_gpu_checks():
    floats = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
    assert [d for d in floats if finite_device.checkable(d)] == floats
    assert not finite_device.checkable("float64")  # (8 bytes: the host's)
    assert not finite_device.checkable("int32") and not finite_device.checkable("uint8")  # (nothing to check)
