"""The GPU the daemons run on, as nvidia-smi sees it.

The benchmark process never touches CUDA itself: a context of its own would take
device memory and show up in the very figures it measures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

SETTLE_TIMEOUT = 30.0  # seconds for the device's used memory to return to its baseline after a daemon stops
BASELINE_SLACK_MIB = 16  # memory.used jitters by a few MiB


def smi(*args: str) -> list[list[str]]:
    """nvidia-smi's CSV answer (no header, no units) as rows of stripped cells."""
    r = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"nvidia-smi {' '.join(args)} exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return [[c.strip() for c in line.split(",")] for line in r.stdout.splitlines() if line.strip()]


def _mib_or_none(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


@dataclass
class Gpu:
    select: str  # nvidia-smi -i: a physical index or a UUID (CUDA_VISIBLE_DEVICES maps the logical one)
    uuid: str
    name: str
    total_mib: int

    @classmethod
    def for_device(cls, device: str) -> Gpu | None:
        """The GPU `--device` names (auto: the first, if there is one); None on CPU."""
        if not (device.startswith("cuda") or device == "auto"):
            return None
        if shutil.which("nvidia-smi") is None:
            if device.startswith("cuda"):
                raise RuntimeError(f"--device {device}: device memory is read with nvidia-smi, which is not on PATH")
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
        select = visible[index] if visible else str(index)
        try:
            [[uuid, name, total]] = smi("--query-gpu=uuid,name,memory.total", "-i", select)
        except (RuntimeError, ValueError, OSError):
            if device == "auto":
                return None
            raise
        return cls(select, uuid, name, int(float(total)))

    def used_mib(self) -> int:
        [[used]] = smi("--query-gpu=memory.used", "-i", self.select)
        return int(float(used))

    def apps(self) -> dict[int, int | None]:
        """MiB of device memory per process with a context on this device."""
        out: dict[int, int | None] = {}
        for row in smi("--query-compute-apps=pid,used_memory,gpu_uuid"):
            if len(row) >= 3 and row[2] == self.uuid:
                out[int(row[0])] = _mib_or_none(row[1])
        return out

    def settle_to(self, baseline: int, timeout: float = SETTLE_TIMEOUT) -> tuple[int, float]:
        """Poll until the device's used memory is back to `baseline` (within a few MiB):
        (the last reading, seconds waited)."""
        t0 = time.perf_counter()
        while True:
            used = self.used_mib()
            waited = time.perf_counter() - t0
            if used <= baseline + BASELINE_SLACK_MIB or waited > timeout:
                return used, waited
            time.sleep(0.25)
