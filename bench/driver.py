"""Driving a real daemon from outside, as an operator would: the `preload` command line
in subprocesses, free ports, HTTP probes and /status polls with the standard library,
and a stop that leaves no process behind. The benchmarks and the tests both use it.

Nothing here parses the daemon's log: what a benchmark needs to know (worker pids and
states, when a worker was killed, reaped, forked, given its slot, ready) the daemon
publishes in /status.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

# The installed `preload` script beside this interpreter; where the package was copied
# rather than installed (the device machines), the same command through `python -m`.
SCRIPT = Path(sys.executable).with_name("preload")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "preload.cli.main"]
COMMAND_TIMEOUT = 120.0  # seconds for one `preload` command
START_TIMEOUT = 600.0  # for `preload start`: ~3-6 s of imports, and the load of a checkpoint of any size


class DaemonError(RuntimeError):
    """`preload start` failed, or a running daemon did not answer as it should."""


def free_port() -> int:
    """A port to listen on that nothing holds now, from below the kernel's ephemeral range:
    one from that range (port 0's) may be handed to any process's outgoing connection or
    listener before ours binds it (a test's daemon once found its API port taken so). Test
    processes side by side (pytest-xdist's workers, and what they start) take theirs from
    slices of their own: two that chose the same port before either bound it, one failed."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 16384)
    runner = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    if runner.isdigit():
        size = (low - first) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        first += int(runner) * size % (low - first)
        low = first + size
    for _ in range(100):
        port = random.randrange(first, low)
        if port_is_free(port):
            return port
    with socket.socket() as s:  # (a crowded range: the kernel's choice)
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


def preload(*args, timeout: float = COMMAND_TIMEOUT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real `preload` command line; never on a terminal (no progress bar); `env`:
    set in its environment, beside ours."""
    return subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=None if env is None else os.environ | env)


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a GET on a fresh connection to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until `predicate()` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@dataclass
class Daemon:
    """A daemon started by `preload start`, ready (the command returns only then)."""

    state_dir: Path
    port: int  # the health port: /health, /status, /metrics
    pid: int
    model: Path | None
    start: subprocess.CompletedProcess  # the `preload start` that launched it
    api_port: int | None = None  # the workers' port, when it runs workers
    status_errors: int = 0  # /status answers other than 200 (retried, and counted: reported, not hidden)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict:
        for attempt in range(5):
            code, body = http_get(self.port, "/status")
            if code == 200:
                return json.loads(body)
            self.status_errors += 1
            time.sleep(0.01)
        raise DaemonError(f"{self.url}/status answered {code}: {body[:200]!r}")

    def workers(self) -> list[dict]:
        return self.status()["workers"]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.state_dir / "daemon.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        stop_everything(self.state_dir, (self.pid,), timeout)


def start_daemon(state_dir: Path, model: Path | None, *extra, port: int | None = None,
                 api_port: int | None = None, timeout: float = START_TIMEOUT) -> Daemon:
    """`preload start` on `state_dir` with a free health port (or `port`), and with
    `--port api_port` when given; returns once the daemon is ready, else raises
    DaemonError with its output and the end of its log (and leaves nothing running)."""
    port = port or free_port()
    args = ["start", "--state-dir", state_dir, "--health-port", port, *extra]
    if "--workers" not in extra:  # (the command's default is one worker; a bench asks for what it measures)
        args += ["--workers", 0]
    if model is not None:
        args += ["--model", model]
    if api_port is not None:
        args += ["--port", api_port]
    try:
        result = preload(*args, timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = _logs_tail(Path(state_dir))  # (before the stop: what it was waiting for)
        stop_everything(state_dir)
        raise DaemonError(f"preload start not ready within {timeout:.0f} s:\n{tail}") from None
    except BaseException:  # (interrupted: Ctrl-C, or SIGTERM as cli/bench.py has it) the daemon is detached
        stop_everything(state_dir)
        raise
    match = re.search(r"\(pid (\d+)\)", result.stdout)
    if result.returncode != 0 or not match:
        stop_everything(state_dir)
        raise DaemonError(f"preload start failed ({result.returncode}):\n{result.stdout}{result.stderr}\n"
                          f"{_logs_tail(Path(state_dir))}")
    return Daemon(Path(state_dir), port, int(match.group(1)), model, result, api_port)


def _logs_tail(state_dir: Path, chars: int = 3000) -> str:
    """The end of the daemon's log and of each worker's, front's and spare's: a start that
    failed or hung says why there."""
    logs = [state_dir / "daemon.log", *sorted(state_dir.glob("worker-*.log")), *sorted(state_dir.glob("front-*.log")),
            state_dir / "spares.log"]
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-chars:]}" for log in logs if log.exists())


@contextmanager
def running_daemon(model: Path | None, *extra, port: int | None = None, api_port: int | None = None):
    """A daemon on a temporary state dir for the length of a `with` block; stopped,
    whatever survived that killed, and its state dir removed on the way out."""
    state_dir = Path(tempfile.mkdtemp(prefix="preload-bench-"))
    try:
        d = start_daemon(state_dir, model, *extra, port=port, api_port=api_port)
        try:
            yield d
        finally:
            d.stop()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def daemon_processes(state_dir: Path) -> list[psutil.Process]:
    """Live processes started for `state_dir`: the daemon (whose command line names its
    state dir) and anything it spawned with the same flag."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        # (argv as spawned, or a process title, which is one string: `preload worker 1 --state-dir X`)
        if f"--state-dir {state_dir} " in " ".join(cmd) + " ":
            found.append(proc)
    return found


def stop_everything(state_dir: Path, pids: tuple[int, ...] = (), timeout: float = 15.0) -> None:
    """`preload stop`; then SIGKILL whatever daemon for this state dir survived it, and
    its children (workers, the zygote: a daemon killed this way cannot stop them)."""
    state_dir = Path(state_dir)
    if (state_dir / "control.sock").exists():
        try:
            preload("stop", "--state-dir", state_dir, "--timeout", timeout, timeout=timeout + 15)
        except subprocess.TimeoutExpired:
            pass
    lock = state_dir / "daemon.lock"
    lock_pid = lock.read_text().strip() if lock.exists() else ""
    survivors = {p.pid: p for p in daemon_processes(state_dir)}
    for pid in {*pids, *([int(lock_pid)] if lock_pid.isdigit() else [])}:
        try:
            proc = psutil.Process(pid)
            if str(state_dir) in " ".join(proc.cmdline()):  # ours, not a recycled pid
                survivors[pid] = proc
        except psutil.Error:
            pass
    for proc in list(survivors.values()):
        try:
            survivors |= {c.pid: c for c in proc.children(recursive=True)}
        except psutil.Error:
            pass
    for proc in survivors.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(list(survivors.values()), timeout=10)
