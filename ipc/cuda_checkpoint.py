"""The CUDA driver's checkpoint of another process (`cuCheckpointProcess*`, Linux, driver
550 and later): every allocation, context, stream, kernel and graph a process holds on
its GPU moved to host memory and the device memory freed (its context's too), then put
back at the same addresses, the process none the wiser but for the time its CUDA calls
wait meanwhile.

It does not cover a process that maps another process's VMM memory (restore answers
CUDA_ERROR_NOT_SUPPORTED), as every worker maps the daemon's arena; it does once that
process has let the mapping go, its address range kept, and maps the memory there again
after the restore: H100, driver 580.159.04, a process of 1,716 MiB checkpointed in 1.04 s
and restored in 0.51 s, a CUDA graph captured before replayed to the same result
(scripts/probe_cuda_checkpoint.py --unmap-first, results/probes). A warm spare kept through
a level-1 sleep this way (7f89077, caec7b4) was restored in 2.4 s on that H100, slower than a
fork serves after the wake: the sleep keeps its spares on the device instead
(preloadd/sleeping.py, docs/operating.md); the probe uses this module.
"""

from __future__ import annotations

import ctypes
import threading

from preload.ipc.devices import driver

LOCK_TIMEOUT_MS = 10_000  # for the process's work in flight to finish before the lock
CALL_TIMEOUT = 60.0  # seconds for any one call; past it the caller kills the process


class CheckpointError(RuntimeError):
    pass


class _LockArgs(ctypes.Structure):
    """CUcheckpointLockArgs: without one the lock waits for the process's work forever."""
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


def available() -> bool:
    """Whether this host's driver has the checkpoint calls."""
    try:
        cu = driver()
    except OSError:
        return False
    return all(hasattr(cu, f"cuCheckpointProcess{step}") for step in ("Lock", "Checkpoint", "Restore", "Unlock"))


def call(step: str, pid: int) -> None:
    """cuCheckpointProcess<step>(pid) (step: Lock, Checkpoint, Restore or Unlock), waited
    for up to CALL_TIMEOUT in a thread of its own (a call the driver never returns from must
    not hold the daemon). Raises CheckpointError naming CUDA's error."""
    cu, answer = driver(), []
    args = ctypes.byref(_LockArgs(LOCK_TIMEOUT_MS)) if step == "Lock" else None
    fn = getattr(cu, f"cuCheckpointProcess{step}")
    worker = threading.Thread(target=lambda: answer.append(fn(ctypes.c_int(pid), args)), daemon=True,
                              name=f"cuda-checkpoint-{step.lower()}")
    worker.start()
    worker.join(CALL_TIMEOUT)
    if not answer:
        raise CheckpointError(f"cuCheckpointProcess{step}({pid}): no answer in {CALL_TIMEOUT:.0f} s")
    if answer[0] != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(answer[0], ctypes.byref(name))
        raise CheckpointError(f"cuCheckpointProcess{step}({pid}) failed: {(name.value or b'?').decode()}")


def suspend(pid: int) -> None:
    """Lock the process (its work in flight done, its next CUDA call held) and move its
    device state to host memory. Raises CheckpointError, the process unlocked if it can be."""
    driver().cuInit(0)
    call("Lock", pid)
    try:
        call("Checkpoint", pid)
    except CheckpointError:
        try:
            call("Unlock", pid)
        except CheckpointError:
            pass  # (the caller kills it)
        raise


def resume(pid: int) -> None:
    """Put a suspended process's device state back and let its CUDA calls go on."""
    call("Restore", pid)
    call("Unlock", pid)
