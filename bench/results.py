"""What every benchmark's result carries (the command, the machine, the load around
it), the one quantile rule they all report with, and the table cells they print."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil

from preload.preloadd.install import uncompiled_imports

MiB = 2**20


def host_info() -> dict:
    """This machine, without importing torch or touching CUDA."""
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = None
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch,
        # (what every fresh interpreter compiles again: seconds of each cold start)
        "compiled_from_source": uncompiled_imports(),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def begin(benchmark: str, device: str | None = None, gpu=None) -> dict:
    """The head of a result: which benchmark, the command that ran it, the machine
    (and its GPU, a `bench.gpu.Gpu`, if any), the load average before."""
    machine = host_info() | ({"device_requested": device} if device else {})
    if gpu is not None:
        machine |= {"cuda_device": gpu.name, "gpu_uuid": gpu.uuid, "gpu_total_mib": gpu.total_mib,
                    "nvidia_smi_index": gpu.select}
    return {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "loadavg_before": os.getloadavg(),
    }


def finish(result: dict, t0: float) -> dict:
    """The tail: wall seconds since `t0` (a perf_counter reading), the load average after."""
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_after"] = os.getloadavg()
    return result


def quantiles(values, percents: tuple[int, ...] = (50, 90)) -> dict | None:
    """pNN (linear interpolation between closest ranks), min, max, mean and n; None
    when there are no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None

    def pick(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        f = int(k)
        return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)

    return {**{f"p{p}": pick(p) for p in percents}, "min": xs[0], "max": xs[-1], "mean": sum(xs) / len(xs),
            "n": len(xs)}


def row(cells, widths) -> str:
    """One table line: the first cell left-aligned, the others right-aligned."""
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()


def sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def mib(n: float | None) -> str:
    """Bytes as MiB."""
    return "-" if n is None else f"{n / MiB:.1f}"
