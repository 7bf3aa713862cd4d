"""Which of a zygote's imports leave threads behind, and whether a fork's child starts with
more than one (Python 3.12 warns at fork when a process has threads). Run it as the zygote
runs: OPENBLAS_NUM_THREADS=1 python3 scripts/probe_zygote_threads.py [SECONDS_TO_SLEEP_AFTER]
(then `py-spy dump --native --pid PID` names the threads' libraries)."""

import importlib
import os
import sys
import time


def threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def child_threads() -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, str(threads()).encode())
        os._exit(0)
    os.close(w)
    n = int(os.read(r, 16))
    os.close(r)
    os.waitpid(pid, 0)
    return n


def triton_kernels() -> None:
    from preload.kernels import triton_import_steps

    for step in triton_import_steps():
        step()


steps = [(m, lambda m=m: importlib.import_module(m)) for m in
         ("setproctitle", "numpy", "fastapi", "torch", "uvicorn", "preload.worker.serve")]
for name, step in [*steps, ("triton kernels", triton_kernels)]:
    t = time.perf_counter()
    step()
    print(f"{name:22s} {time.perf_counter() - t:5.2f} s  threads {threads():3d}  a fork's child: {child_threads()}", flush=True)
print("pid", os.getpid(), flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
