"""The driver's checkpoint calls (ipc/cuda_checkpoint.py): there only where the driver has
all four; each call's CUDA error named; a checkpoint that fails unlocks the process
again; a call the driver never returns from is given up. A fake driver stands in for
libcuda here; the real one is tests/gpu/test_sleep_level1.py's."""

from __future__ import annotations

import ctypes
import threading

import pytest

from preload.ipc import cuda_checkpoint


class FakeDriver:
    """cuCheckpointProcess* answering from `answers` (step -> CUresult), in order called."""

    def __init__(self, answers: dict[str, int], steps=("Lock", "Checkpoint", "Restore", "Unlock")):
        self.calls: list[tuple[str, int]] = []
        for step in steps:
            setattr(self, f"cuCheckpointProcess{step}", self._answer(step, answers.get(step, 0)))

    def _answer(self, step: str, rc: int):
        def call(pid, args):
            self.calls.append((step, pid.value))
            if rc == -1:
                threading.Event().wait(5)  # (never answers in the test's time)
            return rc
        return call

    def cuInit(self, flags):
        return 0

    def cuGetErrorName(self, rc, name_ptr):
        ctypes.cast(name_ptr, ctypes.POINTER(ctypes.c_char_p))[0] = {801: b"CUDA_ERROR_NOT_SUPPORTED"}.get(rc, b"?")
        return 0


def use(monkeypatch, fake) -> None:
    monkeypatch.setattr(cuda_checkpoint, "driver", lambda: fake)


def test_available_only_where_the_driver_has_all_four_calls(monkeypatch):
    use(monkeypatch, FakeDriver({}))
    assert cuda_checkpoint.available()
    use(monkeypatch, FakeDriver({}, steps=("Lock", "Checkpoint")))  # (an older driver)
    assert not cuda_checkpoint.available()

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cuda_checkpoint, "driver", no_driver)
    assert not cuda_checkpoint.available()


def test_suspend_and_resume_call_the_driver_in_order(monkeypatch):
    fake = FakeDriver({})
    use(monkeypatch, fake)
    cuda_checkpoint.suspend(1234)
    cuda_checkpoint.resume(1234)
    assert fake.calls == [("Lock", 1234), ("Checkpoint", 1234), ("Restore", 1234), ("Unlock", 1234)]


def test_a_checkpoint_that_fails_unlocks_the_process_and_says_why(monkeypatch):
    fake = FakeDriver({"Checkpoint": 801})
    use(monkeypatch, fake)
    with pytest.raises(cuda_checkpoint.CheckpointError, match=r"Checkpoint\(7\) failed: CUDA_ERROR_NOT_SUPPORTED"):
        cuda_checkpoint.suspend(7)
    assert fake.calls == [("Lock", 7), ("Checkpoint", 7), ("Unlock", 7)]


def test_a_call_that_never_returns_is_given_up(monkeypatch):
    use(monkeypatch, FakeDriver({"Restore": -1}))
    monkeypatch.setattr(cuda_checkpoint, "CALL_TIMEOUT", 0.2)
    with pytest.raises(cuda_checkpoint.CheckpointError, match="no answer in"):
        cuda_checkpoint.resume(9)
