"""Running the real daemon from tests: the `preload` CLI in subprocesses, free ports,
HTTP probes, and a cleanup that leaves nothing behind whatever the test did.

Every daemon gets its own state dir and health port. `running_daemon` stops it with
`preload stop` and, failing that, kills the daemon process (found by its pid, from
the state dir's lock file or from its command line naming that state dir).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

PRELOAD = str(Path(sys.executable).with_name("preload"))
ARENA_LABEL = "memfd:preload-arena"
START_TIMEOUT = 120  # seconds; a start costs ~3 s (import torch), more on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def preload(*args, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess:
    """Run the real `preload` command line; never on a terminal (no progress bar)."""
    return subprocess.run(
        [PRELOAD, *map(str, args)], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def daemon_processes(state_dir: Path) -> list[psutil.Process]:
    """Live processes started for `state_dir`: the daemon (whose command line names its
    state dir) and anything it spawned with the same flag (workers)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        if any(a == "--state-dir" and b == str(state_dir) for a, b in zip(cmd, cmd[1:])):
            found.append(proc)
    return found


def sockets_in(state_dir: Path) -> list[str]:
    return sorted(p.name for p in state_dir.glob("*.sock")) if state_dir.exists() else []


def arena_inodes(pid: int) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every preload arena memfd open in process `pid`."""
    found = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return found
    for fd in fds:
        try:
            if os.readlink(fd).startswith("/" + ARENA_LABEL):
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


@dataclass
class RunningDaemon:
    state_dir: Path
    port: int
    pid: int
    model: Path
    start: subprocess.CompletedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def status(self) -> dict:
        r = self.get("/status")
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        return metrics(self.get("/metrics").text)


def stop_everything(state_dir: Path, pids: tuple[int, ...] = ()) -> None:
    """`preload stop`; then SIGKILL whatever daemon for this state dir survived it."""
    if (state_dir / "control.sock").exists():
        try:
            preload("stop", "--state-dir", state_dir, "--timeout", 15, timeout=30)
        except subprocess.TimeoutExpired:
            pass
    lock = state_dir / "daemon.lock"
    lock_pid = lock.read_text().strip() if lock.exists() else ""
    candidates = {p.pid: p for p in daemon_processes(state_dir)}
    for pid in {*pids, *([int(lock_pid)] if lock_pid.isdigit() else [])}:
        try:
            proc = psutil.Process(pid)
            if any(str(state_dir) == a for a in proc.cmdline()):  # ours, not a recycled pid
                candidates[pid] = proc
        except psutil.Error:
            pass
    for proc in candidates.values():
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        except psutil.Error:
            pass


@contextmanager
def running_daemon(state_dir: Path, model: Path | None, *extra, quant: str = "none", port: int | None = None):
    """A daemon started by `preload start` (which returns once it is ready), stopped
    and, failing that, killed on the way out."""
    port = port or free_port()
    args = ["start", "--state-dir", state_dir, "--health-port", port, "--quant", quant, *extra]
    if model is not None:
        args += ["--model", model]
    pids: tuple[int, ...] = ()
    try:
        result = preload(*args)
        match = re.search(r"\(pid (\d+)\)", result.stdout)
        if match:
            pids = (int(match.group(1)),)
        assert result.returncode == 0 and match, f"preload start failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        yield RunningDaemon(state_dir, port, pids[0], model, result)
    finally:
        stop_everything(state_dir, pids)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until `predicate()` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
