"""What reading a checkpoint's files alone costs: the references a start is measured
against (bench/cold.py): its files, largest tensor, a read into one buffer, `cat`, and
`python -c 'import torch'`; and dropping the files from the page cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return files


def largest_tensor(files: list[Path]) -> tuple[str, int]:
    """The biggest tensor by bytes, from the safetensors headers alone."""
    best = ("", 0)
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                size = info["data_offsets"][1] - info["data_offsets"][0]
                best = max(best, (name, size), key=lambda x: x[1])
    return best


def evict_from_page_cache(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (dirty pages are written back first)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cat_files(files: list[Path]) -> float:
    """Seconds `cat` takes to read the files (to /dev/null): the reference the cold-start
    targets are stated against."""
    t = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def import_torch() -> float:
    """Seconds `python -c 'import torch'` takes: what a start pays before any of its own work."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t


def read_files(files: list[Path], buffer: bytearray) -> tuple[float, int]:
    """Seconds and bytes to read every file start to end into `buffer`, chunk after chunk."""
    view = memoryview(buffer)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return time.perf_counter() - t0, total
