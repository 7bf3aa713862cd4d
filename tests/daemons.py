"""Running the real daemon from tests: the shared driver (preload.bench.driver, which
the benchmarks use too) with what only tests need on top: httpx responses, Prometheus
text, and where the arena's memfd is still held.

Every daemon gets its own state dir and health port. `running_daemon` stops it with
`preload stop` and, failing that, kills the daemon process (found by its pid, from
the state dir's lock file or from its command line naming that state dir).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from preload.bench.driver import (  # noqa: F401 - re-exported: the tests import them from here
    SCRIPT,
    Daemon,
    daemon_processes,
    free_port,
    port_is_free,
    preload,
    start_daemon,
    stop_everything,
    wait_for,
)

PRELOAD = str(SCRIPT)  # tests run in the virtualenv, where the script is installed
ARENA_LABEL = "memfd:preload-arena"
KV_LABEL = "memfd:preload-kv"  # a worker's KV memory on the CPU (ipc/kv_memory.py)
START_TIMEOUT = 120  # seconds; a start costs ~3 s (import torch), more on a loaded machine


def sockets_in(state_dir: Path) -> list[str]:
    return sorted(p.name for p in state_dir.glob("*.sock")) if state_dir.exists() else []


def arena_inodes(pid: int, label: str = ARENA_LABEL) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every preload arena memfd (or other memfd `label`) open in process `pid`."""
    found = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return found
    for fd in fds:
        try:
            if os.readlink(fd).startswith("/" + label):
                st = os.stat(fd)
                found.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    return found


def arena_holders(inodes: set[tuple[int, int]]) -> dict[int, str]:
    """Processes that still hold one of these arenas, as an open fd or as a mapping."""
    holders = {}
    inos = {ino for _, ino in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if arena_inodes(pid) & inodes:
            holders[pid] = "fd"
            continue
        try:
            maps = (entry / "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and ARENA_LABEL in fields[5] and int(fields[4]) in inos:
                holders[pid] = "mapping"
                break
    return holders


def metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def total(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (the workers'
    series carry model_name and worker labels; a test rarely cares which)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [v for key, v in m.items() if key.split("{")[0] == name and all(w in key for w in want)]
    assert found, f"no {name} {labels} in the metrics"
    return sum(found)


@dataclass
class RunningDaemon(Daemon):
    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def metrics(self) -> dict[str, float]:
        return metrics(self.get("/metrics").text)


@contextmanager
def running_daemon(state_dir: Path, model: Path | None, *extra, quant: str = "none", port: int | None = None):
    """A daemon started by `preload start` (which returns once it is ready), stopped
    and, failing that, killed on the way out."""
    d = start_daemon(state_dir, model, "--quant", quant, *extra, port=port, timeout=START_TIMEOUT)
    try:
        yield RunningDaemon(**vars(d))
    finally:
        d.stop(timeout=15)
